package cost

import (
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"

	"github.com/caddy-redis/ratelimit/internal/logs"
	"github.com/caddyserver/caddy/v2"
)

// Weighted sums: `requested_tokens` and `charge json` as terms, each a
// product of factors, summed and rounded up to whole tokens. With
// prices from a `map` on the model, a limit counts money:
//
//	requested_tokens {http.rate_limit.request.max_tokens:4096}*{http.rate_limit.request.n:1}*{out_price} {http.request.header.Content-Length}*{in_price_per_byte}
//	charge json usage.prompt_tokens*{in_price} usage.completion_tokens*{out_price}
//
// A term is factors joined by '*', terms separated by spaces (in JSON,
// one string for requested_tokens, a string per path for charge json).
// A factor is a number, 0 or more (fractions allowed), or placeholders;
// the first factor of a charge json term is a path of the response body
// instead. A factor written as a number is judged at load; one with
// placeholders per request. A factor from the request, the first of a
// requested_tokens term or one that names a value of the body
// (`{http.rate_limit.request.<path>}`), out of range refuses the request
// with 400, as requested_tokens always did; any other (a weight: a
// price from a map) with 500, as a rate out of range does (it is the
// configuration's mistake, not the client's). Products and sums are
// exact decimals (amount.go).

// Term is one term of a weighted sum, compiled: the product of its
// factors written as numbers, and its factors with placeholders.
type Term struct {
	fixed   amount
	factors []factor // with placeholders, resolved per request
}

// factor is a factor with placeholders.
type factor struct {
	text string // as written
	// key is the placeholder the factor is, when it is one and nothing
	// else: read with Get, without building a string (8 allocs less per
	// request of make bench's llm@64 handler: BenchmarkServeHTTPLLM/llm
	// 40 -> 32).
	key string
	// fromRequest: the client's value (the first factor of a
	// requested_tokens term, or one naming a value of the body), whose
	// mistakes refuse with 400; else a weight, 500.
	fromRequest bool
	// place is the factor's index in a request's Memo, when one is
	// free; else -1 (resolved at each use).
	place int
}

// maxWeightPlaces bounds the distinct factors with placeholders a
// request remembers; more are resolved at each use.
const maxWeightPlaces = 16

// Memo is a request's factors with placeholders, each resolved once:
// the reservation, the check of charge json's weights and the
// settlement read the same `{out_price}` of a `map`, which would
// otherwise walk the replacer's providers and run the map again each
// time (6 map lookups per request of make bench's llm@64 -> 3).
// The settlement so charges with the weights the request was admitted
// with, those the check judged.
type Memo struct {
	known  uint16 // a bit per place resolved
	values [maxWeightPlaces]amount
}

// value is f's value for the request: remembered, or resolved now (and
// remembered). m may be nil: nothing is remembered. param names the sum
// in the message of a value from the request.
func (m *Memo) value(f *factor, param string, repl *caddy.Replacer) (amount, error) {
	if m == nil || f.place < 0 {
		return resolveFactor(f, param, repl)
	}
	bit := uint16(1) << f.place
	if m.known&bit != 0 {
		return m.values[f.place], nil
	}
	v, err := resolveFactor(f, param, repl)
	if err == nil {
		m.values[f.place], m.known = v, m.known|bit
	}
	return v, err
}

// Reset forgets what m resolved, for another request.
func (m *Memo) Reset() { m.known = 0 }

// product is the term's value for the request.
func (t *Term) product(param string, repl *caddy.Replacer, memo *Memo) (amount, error) {
	p := t.fixed
	for i := range t.factors {
		v, err := memo.value(&t.factors[i], param, repl)
		if err != nil {
			return amount{}, err
		}
		p = p.mul(v)
	}
	return p, nil
}

// Places gives each distinct factor with placeholders of a handler's
// sums (its requested_tokens and charge json) a place in its requests'
// Memo, the first maxWeightPlaces of them.
type Places struct{ texts []string }

// Assign gives the factors of terms their places.
func (p *Places) Assign(terms []Term) {
	for i := range terms {
		for j := range terms[i].factors {
			f := &terms[i].factors[j]
			k := slices.Index(p.texts, f.text)
			if k < 0 && len(p.texts) < maxWeightPlaces {
				k, p.texts = len(p.texts), append(p.texts, f.text)
			}
			f.place = k
		}
	}
}

// onePlaceholder is the name of the placeholder that text is, when it is
// one and nothing else (`{out_price}`), else "".
func onePlaceholder(text string) string {
	if len(text) > 2 && text[0] == '{' && text[len(text)-1] == '}' && strings.Count(text, "{") == 1 && strings.Count(text, "}") == 1 {
		return text[1 : len(text)-1]
	}
	return ""
}

// resolveText is text with its placeholders replaced for a request.
func resolveText(text, key string, repl *caddy.Replacer) string {
	if key != "" {
		v, _ := repl.GetString(key)
		return v
	}
	return repl.ReplaceAll(text, "")
}

// maxTerms bounds the terms of one sum.
const maxTerms = 16

const (
	wantWeight  = "want a number, 0 or more (fractions allowed, such as 0.25), or a placeholder that resolves to one"
	wantFactors = "write factors joined by one '*', each a number or placeholders, such as {http.rate_limit.request.max_tokens}*{http.rate_limit.request.n:1}*0.07"
)

// RequestValuePrefix starts the placeholders of request_body's values
// (`{http.rate_limit.request.<path>}`): a factor that names one is the
// client's.
const RequestValuePrefix = "{http.rate_limit.request."

// IsWeighted says whether a requested_tokens text is a weighted sum
// rather than the one value it always was.
func IsWeighted(text string) bool {
	return strings.ContainsRune(text, '*') || len(strings.Fields(text)) > 1
}

// splitFactors parts a term at each '*' outside braces.
func splitFactors(term string) []string {
	var parts []string
	depth, start := 0, 0
	for i := 0; i < len(term); i++ {
		switch term[i] {
		case '{':
			depth++
		case '}':
			depth--
		case '*':
			if depth == 0 {
				parts, start = append(parts, term[start:i]), i+1
			}
		}
	}
	return append(parts, term[start:])
}

// balanced says whether text's braces pair up, one level deep, as
// placeholders are written.
func balanced(text string) bool {
	open := false
	for i := 0; i < len(text); i++ {
		switch text[i] {
		case '{':
			if open {
				return false
			}
			open = true
		case '}':
			if !open {
				return false
			}
			open = false
		}
	}
	return !open
}

// compileTerm compiles a term's factors (after its path, for charge
// json: then valueFirst is false). param and term name it in messages.
func compileTerm(param, term string, factors []string, valueFirst bool) (Term, error) {
	t := Term{fixed: amount{mant: 1}}
	for i, text := range factors {
		isValue := valueFirst && i == 0
		switch {
		case text == "":
			return Term{}, fmt.Errorf("%s '%s': an empty factor (a '*' at an end, or two together); %s", param, term, wantFactors)
		case !balanced(text):
			return Term{}, fmt.Errorf("%s '%s': factor '%s' has a brace without its pair; a placeholder is written {name}, such as {http.rate_limit.request.n:1}", param, term, logs.Cut(text))
		case strings.Contains(text, "{"):
			t.factors = append(t.factors, factor{text: text, key: onePlaceholder(text), place: -1,
				fromRequest: isValue || strings.Contains(text, RequestValuePrefix)})
			continue
		}
		v, err := parseAmount(text)
		switch {
		case err != nil && isValue:
			return Term{}, fmt.Errorf("%s '%s': value '%s' %s; want a number of tokens, 0 or more, or a placeholder", param, term, logs.Cut(text), err)
		case err != nil:
			return Term{}, fmt.Errorf("%s '%s': weight '%s' %s; %s", param, term, logs.Cut(text), err, wantWeight)
		}
		t.fixed = t.fixed.mul(v)
	}
	return t, nil
}

// parseAmount reads a value or weight: a finite number, 0 or more,
// exactly when it is written in decimal.
func parseAmount(text string) (amount, error) {
	text = strings.TrimSpace(text)
	v, err := strconv.ParseFloat(text, 64)
	switch {
	case err != nil && !math.IsInf(v, 0):
		return amount{}, fmt.Errorf("is not a number")
	case err != nil || math.IsInf(v, 0):
		return amount{}, fmt.Errorf("is infinite")
	case math.IsNaN(v):
		return amount{}, fmt.Errorf("is not a number")
	case v < 0:
		return amount{}, fmt.Errorf("is negative")
	}
	if a, ok := decimalOf(text); ok {
		return a, nil
	}
	return amount{f: v, inexact: true}, nil
}

// ParseTerms compiles a weighted requested_tokens: its terms, and, when
// none has a placeholder, the sum (fixed true). Its errors name the term
// and what is wrong with it.
func ParseTerms(text string) (terms []Term, sum int64, fixed bool, err error) {
	fields := strings.Fields(text)
	if len(fields) > maxTerms {
		return nil, 0, false, fmt.Errorf("requested_tokens '%s': %d terms, more than %d; sum fewer", logs.Cut(text), len(fields), maxTerms)
	}
	fixed = true
	var total amount
	for _, f := range fields {
		factors := splitFactors(f)
		if factors[0] == "" {
			return nil, 0, false, fmt.Errorf("requested_tokens '%s': a term without a value; write <value>*<weight>, such as {http.rate_limit.request.max_tokens}*{price}", f)
		}
		t, err := compileTerm("requested_tokens", f, factors, true)
		if err != nil {
			return nil, 0, false, err
		}
		fixed = fixed && t.factors == nil
		total = total.add(t.fixed)
		terms = append(terms, t)
	}
	if fixed {
		sum = roundTerms(total)
	}
	return terms, sum, fixed, nil
}

// roundTerms rounds a weighted sum up to whole tokens: at least 1 (a
// request takes something), at most 2^53.
func roundTerms(total amount) int64 {
	return max(1, total.ceil())
}

// Normalize is a requested_tokens as the checks of a single value judge
// it: a weighted sum of numbers becomes its sum; one with placeholders
// stays as it is, for each request to resolve.
func Normalize(text string) (string, error) {
	if !IsWeighted(text) {
		return text, nil
	}
	_, sum, fixed, err := ParseTerms(text)
	if err != nil || !fixed {
		return text, err
	}
	return strconv.FormatInt(sum, 10), nil
}

// Sum is a request's sum of terms, rounded up to whole tokens (at least
// 1): the values of its factors with placeholders resolved with repl,
// or read from memo when it resolved them before (memo may be nil).
func Sum(terms []Term, repl *caddy.Replacer, memo *Memo) (int64, error) {
	var total amount
	for i := range terms {
		p, err := terms[i].product("requested_tokens", repl, memo)
		if err != nil {
			return 0, err
		}
		total = total.add(p)
	}
	return roundTerms(total), nil
}

// resolveFactor resolves a factor with placeholders for a request. A
// value from the request that resolves to nothing or to no amount is the
// request's fault (400, as a requested_tokens out of range; param names
// it); a weight is the configuration's (500).
func resolveFactor(f *factor, param string, repl *caddy.Replacer) (amount, error) {
	text := resolveText(f.text, f.key, repl)
	if f.fromRequest && text == "" {
		return amount{}, badValue(param, f.text, "resolved to nothing for this request")
	}
	v, err := parseAmount(text)
	switch {
	case err != nil && f.fromRequest:
		return amount{}, badValue(param, text, fmt.Sprintf("(from %s) %s: want a number of tokens, 0 or more", f.text, err))
	case err != nil:
		return amount{}, &ValueError{msg: fmt.Sprintf("weight '%s' resolved to '%s', which %s; %s (check the map or variable that sets it)",
			f.text, logs.Cut(text), err, wantWeight)}
	}
	return v, nil
}

// chargeValueParam names a charge json factor from the request in its
// message (after "charge json: ").
const chargeValueParam = "value"

// ValueError is a factor with placeholders out of range for a request:
// a value from the request (FromRequest), which is the client's mistake
// (400, as a requested_tokens out of range), or a weight, which is the
// configuration's (500, as a rate out of range).
type ValueError struct {
	FromRequest bool
	msg         string
}

func (e *ValueError) Error() string { return e.msg }

// badValue reports a value from the request: "<param> '<value>'
// <reason>", the value quoted cut short.
func badValue(param, value, reason string) *ValueError {
	return &ValueError{FromRequest: true, msg: fmt.Sprintf("%s '%s' %s", param, logs.Cut(value), reason)}
}

// SplitJSONTerm parts a charge json term into its path and the factors
// after it ("" without).
func SplitJSONTerm(term string) (path, factors string) {
	parts := splitFactors(term)
	if len(parts) == 1 {
		return term, ""
	}
	return parts[0], term[len(parts[0])+1:]
}

// CheckJSONTerm judges a charge json term, `<path>[*<factor>]...`, and
// parts it into its path and its factors (as SplitJSONTerm). param names
// it in messages.
func CheckJSONTerm(param, term string) (path, factors string, err error) {
	path, factors, _, err = compileChargeTerm(param, term)
	return path, factors, err
}

// compileChargeTerm judges a charge json term, `<path>[*<factor>]...`,
// and compiles its factors. param names it in messages.
func compileChargeTerm(param, term string) (path, factors string, t Term, err error) {
	path, factors = SplitJSONTerm(term)
	t = Term{fixed: amount{mant: 1}}
	if path == "" {
		return "", "", Term{}, fmt.Errorf("%s '%s': a term without a path; write <path>*<weight>, such as usage.prompt_tokens*{in_price}", param, term)
	}
	if err := checkChargePath(param, term, path); err != nil {
		return "", "", Term{}, err
	}
	if factors != "" || strings.HasSuffix(term, "*") {
		t, err = compileTerm(param, term, splitFactors(factors), false)
	}
	return path, factors, t, err
}

// checkChargePath judges the characters of a charge json path: braces
// (a path is fixed keys of the body, never placeholders), spaces and
// control characters (which separate terms).
func checkChargePath(param, term, path string) error {
	for i := 0; i < len(path); i++ {
		switch c := path[i]; {
		case c == '{' || c == '}':
			return fmt.Errorf("%s '%s': path '%s' cannot hold '%c': a path is fixed keys of the body, not placeholders; put placeholders in a weight after it, such as usage.prompt_tokens*{in_price}",
				param, logs.Cut(term), logs.Cut(path), c)
		case c <= ' ' || c == 0x7f:
			return fmt.Errorf("%s '%s': path '%s' cannot hold spaces or control characters; write keys separated by '.', such as usage.total_tokens, a term per path (in JSON, a string per term)",
				param, logs.Cut(term), logs.Cut(path))
		}
	}
	return nil
}
