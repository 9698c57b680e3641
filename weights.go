package ratelimit

import (
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"
)

// Weighted sums: `requested_tokens` and `charge json` as terms, each a
// value times a weight, summed and rounded up to whole tokens. With
// prices from a `map` on the model, a limit counts money:
//
//	requested_tokens {http.rate_limit.request.max_tokens}*{out_price} {http.request.header.Content-Length}*{in_price_per_byte}
//	charge json usage.prompt_tokens*{in_price} usage.completion_tokens*{out_price}
//
// A term is `<value>` or `<value>*<weight>`, terms separated by spaces
// (in JSON, one string for requested_tokens, a string per path for
// charge json). A value of requested_tokens is a number or placeholders;
// one of charge json a path. A weight is a number or placeholders,
// 0 or more, fractions allowed. A weight written as a number is judged
// at load; one with placeholders per request: negative, not a number or
// infinite, it refuses the request with 500, as a rate out of range does
// (it is the configuration's mistake, not the client's).

// costTerm is one term of a weighted sum, compiled.
type costTerm struct {
	value, weight string  // as written; weight "" is 1
	v, w          float64 // their numbers, when fixed
	fixedV        bool
	fixedW        bool
	// valueKey and weightKey are the placeholder a value or weight is,
	// when it is one and nothing else: read with Get, without building a
	// string (8 allocs less per request of make bench's llm@64 handler:
	// BenchmarkServeHTTPLLM/llm 40 -> 32).
	valueKey, weightKey string
	// place is the weight's index in a request's weightMemo, when it
	// has placeholders and one is free; else -1 (resolved at each use).
	place int
}

// maxWeightPlaces bounds the distinct weights with placeholders a
// request remembers; more are resolved at each use.
const maxWeightPlaces = 16

// weightMemo is a request's weights with placeholders, each resolved
// once: the reservation, the check of charge json's weights and the
// settlement read the same `{out_price}` of a `map`, which would
// otherwise walk the replacer's providers and run the map again each
// time (6 map lookups per request of make bench's llm@64 -> 3).
// The settlement so charges with the weights the request was admitted
// with, those the check judged.
type weightMemo struct {
	known  uint16 // a bit per place resolved
	values [maxWeightPlaces]float64
}

// weight is t's weight for the request: fixed, remembered, or resolved
// now (and remembered). m may be nil: nothing is remembered.
func (m *weightMemo) weight(t *costTerm, repl *caddy.Replacer) (float64, error) {
	if t.fixedW {
		return t.w, nil
	}
	if m == nil || t.place < 0 {
		return resolveWeight(t.weight, t.weightKey, repl)
	}
	bit := uint16(1) << t.place
	if m.known&bit != 0 {
		return m.values[t.place], nil
	}
	w, err := resolveWeight(t.weight, t.weightKey, repl)
	if err == nil {
		m.values[t.place], m.known = w, m.known|bit
	}
	return w, err
}

// assignWeightPlaces gives each distinct weight with placeholders of the
// handler's requested_tokens and charge json a place in the weightMemo.
func (h *Handler) assignWeightPlaces() {
	var places []string
	assign := func(t *costTerm) {
		t.place = -1
		if t.fixedW {
			return
		}
		i := slices.Index(places, t.weight)
		if i < 0 && len(places) < maxWeightPlaces {
			i, places = len(places), append(places, t.weight)
		}
		t.place = i
	}
	for _, l := range h.limits {
		for i := range l.costTerms {
			assign(&l.costTerms[i])
		}
		if l.charge != nil {
			for i := range l.charge.weights {
				assign(&l.charge.weights[i])
			}
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

const wantWeight = "want a number, 0 or more (fractions allowed, such as 0.25), or a placeholder that resolves to one"

// isWeighted says whether a requested_tokens text is a weighted sum
// rather than the one value it always was.
func isWeighted(text string) bool {
	return strings.ContainsRune(text, '*') || len(strings.Fields(text)) > 1
}

// splitTerm parts `<value>*<weight>` at its last '*' outside braces; the
// weight is "" without one.
func splitTerm(term string) (value, weight string) {
	depth := 0
	for i := len(term) - 1; i >= 0; i-- {
		switch term[i] {
		case '}':
			depth++
		case '{':
			depth--
		case '*':
			if depth == 0 {
				return term[:i], term[i+1:]
			}
		}
	}
	return term, ""
}

// checkWeight judges a weight as written: placeholders wait for the
// request; a number must be finite and 0 or more. param and term name
// it in the message.
func checkWeight(param, term, weight string) (float64, bool, error) {
	switch {
	case weight == "":
		return 1, true, nil
	case strings.Contains(weight, "{"):
		return 0, false, nil
	}
	w, err := parseAmount(weight)
	if err != nil {
		return 0, false, fmt.Errorf("%s '%s': weight '%s' %s; %s", param, term, cutValue(weight), err, wantWeight)
	}
	return w, true, nil
}

// parseAmount reads a value or weight: a finite number, 0 or more.
func parseAmount(text string) (float64, error) {
	v, err := strconv.ParseFloat(strings.TrimSpace(text), 64)
	switch {
	case err != nil && !math.IsInf(v, 0):
		return 0, fmt.Errorf("is not a number")
	case err != nil || math.IsInf(v, 0):
		return 0, fmt.Errorf("is infinite")
	case math.IsNaN(v):
		return 0, fmt.Errorf("is not a number")
	case v < 0:
		return 0, fmt.Errorf("is negative")
	}
	return v, nil
}

// parseCostTerms compiles a weighted requested_tokens: its terms, and,
// when none has a placeholder, the sum (fixed true). Its errors name the
// term and what is wrong with it.
func parseCostTerms(text string) (terms []costTerm, sum int64, fixed bool, err error) {
	fields := strings.Fields(text)
	if len(fields) > maxTerms {
		return nil, 0, false, fmt.Errorf("requested_tokens '%s': %d terms, more than %d; sum fewer", cutValue(text), len(fields), maxTerms)
	}
	fixed = true
	for _, f := range fields {
		value, weight := splitTerm(f)
		t := costTerm{value: value, weight: weight, valueKey: onePlaceholder(value), weightKey: onePlaceholder(weight), place: -1}
		if t.w, t.fixedW, err = checkWeight("requested_tokens", f, weight); err != nil {
			return nil, 0, false, err
		}
		switch {
		case value == "":
			return nil, 0, false, fmt.Errorf("requested_tokens '%s': a term without a value; write <value>*<weight>, such as {http.rate_limit.request.max_tokens}*{price}", f)
		case strings.Contains(value, "{"):
		default:
			if t.v, err = parseAmount(value); err != nil {
				return nil, 0, false, fmt.Errorf("requested_tokens '%s': value '%s' %s; want a number of tokens, 0 or more, or a placeholder", f, cutValue(value), err)
			}
			t.fixedV = true
		}
		fixed = fixed && t.fixedV && t.fixedW
		terms = append(terms, t)
	}
	if fixed {
		var total float64
		for _, t := range terms {
			total += t.v * t.w
		}
		sum = roundTerms(total)
	}
	return terms, sum, fixed, nil
}

// roundTerms rounds a weighted sum up to whole tokens: at least 1 (a
// request takes something), at most 2^53.
func roundTerms(total float64) int64 {
	return max(1, ceilTokens(total))
}

// normalizeCost is a requested_tokens as the checks of a single value
// judge it: a weighted sum of numbers becomes its sum; one with
// placeholders stays as it is, for each request to resolve.
func normalizeCost(cost Param) (Param, error) {
	if !isWeighted(string(cost)) {
		return cost, nil
	}
	_, sum, fixed, err := parseCostTerms(string(cost))
	if err != nil || !fixed {
		return cost, err
	}
	return Param(strconv.FormatInt(sum, 10)), nil
}

// resolveTerms sums a request's terms. A value that resolves to nothing
// or to no amount is the request's fault (400, as a requested_tokens
// out of range); a weight is the configuration's (500).
func resolveTerms(terms []costTerm, repl *caddy.Replacer, memo *weightMemo) (int64, error) {
	var total float64
	for i := range terms {
		t := &terms[i]
		v, w := t.v, t.w
		if !t.fixedV {
			text := resolveText(t.value, t.valueKey, repl)
			if text == "" {
				return 0, badValue("requested_tokens", t.value, "resolved to nothing for this request")
			}
			var err error
			if v, err = parseAmount(text); err != nil {
				return 0, badValue("requested_tokens", text, fmt.Sprintf("(from %s) %s: want a number of tokens, 0 or more", t.value, err))
			}
		}
		if !t.fixedW {
			var err error
			if w, err = memo.weight(t, repl); err != nil {
				return 0, err
			}
		}
		total += v * w
	}
	return roundTerms(total), nil
}

// resolveWeight resolves a weight with placeholders for a request.
func resolveWeight(weight, key string, repl *caddy.Replacer) (float64, error) {
	text := resolveText(weight, key, repl)
	w, err := parseAmount(text)
	if err != nil {
		return 0, &paramError{"weight", fmt.Sprintf("weight '%s' resolved to '%s', which %s; %s (check the map or variable that sets it)",
			weight, cutValue(text), err, wantWeight)}
	}
	return w, nil
}

// chargeTerm is a charge json path and its weight, as written.
func chargeTerm(term string) (path, weight string) { return splitTerm(term) }

// checkChargeWeights resolves, before a request is admitted, the
// weights with placeholders of the charge json of its limits, so that a
// weight out of range refuses it (500) rather than costing its response
// nothing. Settlement reads them from memo, the values judged here.
func (h *Handler) checkChargeWeights(buckets []bucket, repl *caddy.Replacer, memo *weightMemo) error {
	for i := range buckets {
		rule := buckets[i].limit.charge
		if rule == nil {
			continue
		}
		for j := range rule.weights {
			if rule.weights[j].fixedW {
				continue
			}
			if _, err := memo.weight(&rule.weights[j], repl); err != nil {
				if name := buckets[i].limit.name; name != "" {
					return fmt.Errorf("limit %s: charge json: %w", name, err)
				}
				return fmt.Errorf("charge json: %w", err)
			}
		}
	}
	return nil
}
