package ratelimit

import (
	"cmp"
	"errors"
	"fmt"
	"maps"
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/caddy-redis/ratelimit/internal/cost"
	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddy-redis/ratelimit/internal/logs"
	"github.com/caddy-redis/ratelimit/internal/scan"
	"github.com/caddyserver/caddy/v2"
)

// Charging: limits whose real cost only the response knows (tokens an
// LLM API used, a cost header, failed logins). Before the request a
// limit takes its requested_tokens as usual: that is the reservation,
// and the check. Once the real cost is known, at the latest once the
// response is written, the difference between it and the reservation is
// settled (settle.lua, or tokenbucket.SettleAt in the process): a smaller cost
// gives tokens back, a larger one takes the rest, into debt down to
// -max_debt. The response passes through a writer that reads its status
// and, for `charge json`, scans its body as it streams by, and settles
// before the end of the answer passes (internal/cost, internal/scan).

// Charge says where the real cost of a response comes from: exactly one
// of its fields is set. A cost that cannot be read (a missing header, not
// a number, a negative number, no usage in the body) keeps the
// reservation. A response cut short (the client left, or the handler
// aborted it) costs its reservation, or what it reported if more.
type Charge struct {
	// Header names a response header whose value is the cost, in tokens
	// (a fraction is rounded up), such as `X-Cost`, read as the response
	// is written, or a trailer of that name, read at its end (a cost known
	// only once a stream ends), which comes first. At most 4 different
	// headers in a handler.
	Header string `json:"header,omitempty"`

	// JSON lists paths of numbers in the response body, summed: keys
	// separated by `.`, an array element by its index
	// (`usage.total_tokens`, `choices.0.n`). A path may carry weights,
	// `<path>*<weight>...` (each a number or placeholders, 0 or more,
	// fractions allowed, multiplied: `usage.prompt_tokens*{in_price}`);
	// the weighted sum is exact in decimal, and rounded up. A path holds
	// no braces or spaces. A weight with placeholders is resolved before
	// the request too, which it refuses with 500 when out of range. A
	// JSON body is read to its end, or to `max_body` when set. In an event stream
	// (`text/event-stream`) each path takes the last value seen in any
	// event's `data:` JSON, and in newline-delimited JSON
	// (`application/x-ndjson`, `application/jsonl`) in any line (the last
	// one with or without its newline), of any size; these are summed at
	// the end. The end of a JSON document, an event whose data starts
	// with `[DONE]`, or an event named as an API's last (`message_stop`,
	// `response.completed`) ends the answer: it is settled there, before
	// those bytes pass on, and nothing after is read. A path not found
	// counts 0; when none is found, the cost cannot be read. At most 16
	// paths in a handler, of at most 8 keys each.
	JSON []string `json:"json,omitempty"`

	// JSONFields reads the body as JSON does, by fields: each name (any,
	// such as `input`) lists the paths where its number may be, and its
	// value is the last number found at any of them, in the order the
	// body gives them; the fields are summed. So an API whose JSON answers
	// and streams report the same count at different paths, or repeat a
	// cumulative count in several events, is charged it once either way:
	// Anthropic's `input` at `usage.input_tokens` and
	// `message.usage.input_tokens`. A path belongs to one field. Paths
	// may carry weights as in JSON, the same on every path of a field,
	// which multiply the field's number: `usage.input_tokens*{in_price}`
	// and `message.usage.input_tokens*{in_price}`. Set either JSON or
	// JSONFields, not both.
	JSONFields map[string][]string `json:"json_fields,omitempty"`

	// Placeholder is read once the response is written, such as
	// `{http.reverse_proxy.duration_ms}` to charge the upstream's time,
	// which `reverse_proxy` sets however the response ends (a fraction is
	// rounded up). Unset or empty, the cost cannot be read.
	Placeholder string `json:"placeholder,omitempty"`
}

// checkCharge judges a charge source: exactly one kind, well formed.
func checkCharge(c *Charge) error {
	if c == nil {
		return nil
	}
	kinds := 0
	for _, set := range []bool{c.Header != "", len(c.JSON) > 0, len(c.JSONFields) > 0, c.Placeholder != ""} {
		if set {
			kinds++
		}
	}
	switch {
	case kinds != 1:
		return errors.New("charge: want exactly one source: header <name>, json <path>..., json { <field> <path>... } (json_fields), or placeholder <{placeholder}>")
	case c.Header != "" && !isHeaderName(c.Header):
		return fmt.Errorf("charge header '%s': not a header name", c.Header)
	case c.Placeholder != "" && !strings.Contains(c.Placeholder, "{"):
		return fmt.Errorf("charge placeholder '%s': want a placeholder, such as {http.reverse_proxy.upstream.duration_ms}", c.Placeholder)
	}
	for _, term := range c.JSON {
		p, _, err := cost.CheckJSONTerm("charge json", term)
		if err != nil {
			return err
		}
		if err := checkJSONPath(p); err != nil {
			return err
		}
	}
	fieldOf := map[string]string{}
	for _, name := range slices.Sorted(maps.Keys(c.JSONFields)) {
		paths := c.JSONFields[name]
		if name == "" || len(paths) == 0 {
			return fmt.Errorf("charge json field '%s': want a name and one or more paths, such as input usage.input_tokens message.usage.input_tokens", name)
		}
		for _, term := range paths {
			p, factors, err := cost.CheckJSONTerm(fmt.Sprintf("charge json field '%s', path", name), term)
			if err != nil {
				return err
			}
			if err := checkJSONPath(p); err != nil {
				return err
			}
			if _, first := cost.SplitJSONTerm(paths[0]); factors != first {
				return fmt.Errorf("charge json field '%s': '%s' and '%s' have different weights ('%s' and '%s'): a field is one count, found at any of its paths, so each path carries the same; write %s",
					name, paths[0], term, orOne(first), orOne(factors), strings.TrimSuffix(p+"*"+first, "*"))
			}
			if other, ok := fieldOf[p]; ok && other != name {
				return fmt.Errorf("charge json field '%s': path '%s' is in field '%s' too; a number counts in one field, remove it from one", name, p, other)
			}
			fieldOf[p] = name
		}
	}
	return nil
}

// orOne is a term's factors as a message shows them: "1" for none.
func orOne(factors string) string { return cmp.Or(factors, "1") }

// jsonFields are a charge's JSON paths by field, a field per path of JSON
// (a term given twice counts once), in a fixed order, without their
// weights (jsonWeights).
func (c *Charge) jsonFields() [][]string {
	var fields [][]string
	for i, term := range c.JSON {
		if !slices.Contains(c.JSON[:i], term) {
			p, _ := cost.SplitJSONTerm(term)
			fields = append(fields, []string{p})
		}
	}
	for _, name := range slices.Sorted(maps.Keys(c.JSONFields)) {
		var paths []string
		for _, term := range c.JSONFields[name] {
			p, _ := cost.SplitJSONTerm(term)
			paths = append(paths, p)
		}
		fields = append(fields, paths)
	}
	return fields
}

// jsonWeights are the terms of jsonFields' fields as written (a field's
// by its first path, which the others match), or nil when no term has a
// factor.
func (c *Charge) jsonWeights() []string {
	var terms []string
	weighted := false
	add := func(term string) {
		_, factors := cost.SplitJSONTerm(term)
		terms = append(terms, term)
		weighted = weighted || factors != ""
	}
	for i, term := range c.JSON {
		if !slices.Contains(c.JSON[:i], term) {
			add(term)
		}
	}
	for _, name := range slices.Sorted(maps.Keys(c.JSONFields)) {
		add(c.JSONFields[name][0])
	}
	if !weighted {
		return nil
	}
	return terms
}

// isHeaderName says whether s is a header field name: a token of
// RFC 9110's tchar.
func isHeaderName(s string) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0) {
			return false
		}
	}
	return s != ""
}

func checkJSONPath(path string) error {
	if err := scan.CheckPath(path); err != nil {
		return fmt.Errorf("charge json '%s': %w", path, err)
	}
	return nil
}

// checkChargeStatus judges charge_status: codes, or classes as Caddy's
// response matchers write them (2 for 2xx).
func checkChargeStatus(statuses []int) error {
	for _, s := range statuses {
		if !(s >= 1 && s <= 5 || s >= 100 && s <= 599) {
			return fmt.Errorf("charge_status '%d': want a status code (100 to 599) or a class (2xx, or 2 in JSON)", s)
		}
	}
	return nil
}

// parseChargeStatus reads a charge_status value: a code, or a class
// written `4xx`.
func parseChargeStatus(v string) (int, error) {
	text := v
	if len(v) == 3 && strings.HasSuffix(v, "xx") {
		text = v[:1]
	}
	n, err := strconv.Atoi(text)
	if err != nil || len(text) == 3 && (n < 100 || n > 599) || len(text) == 1 && (n < 1 || n > 5) || len(text) != 1 && len(text) != 3 {
		return 0, fmt.Errorf("charge_status '%s': want a status code (100 to 599) or a class (2xx)", v)
	}
	return n, nil
}

// checkMaxDebt judges max_debt alone; maxDebtFor bounds it by the rate.
func checkMaxDebt(n *int64) error {
	if n != nil && (*n < 0 || *n > maxExactTokens) {
		return fmt.Errorf("max_debt '%d': want a whole number of tokens from 0 to 2^53", *n)
	}
	return nil
}

// checkMaxBody judges max_body: in JSON 0 stands for no bound.
func checkMaxBody(n int64) error {
	if n < 0 {
		return fmt.Errorf("max_body '%d': want a size in bytes, 1 or more", n)
	}
	return nil
}

// parseSize reads a size: bytes, or a number with a unit (B, KB, KiB,
// MB, MiB, GB, GiB), such as `1MiB`.
func parseSize(v string) (int64, error) {
	end := len(v)
	for end > 0 && (v[end-1] < '0' || v[end-1] > '9') {
		end--
	}
	n, err := strconv.ParseInt(v[:end], 10, 64)
	unit := map[string]int64{"": 1, "b": 1, "kb": 1e3, "kib": 1 << 10, "mb": 1e6, "mib": 1 << 20, "gb": 1e9, "gib": 1 << 30}[strings.ToLower(v[end:])]
	if err != nil || n < 1 || unit == 0 || n > math.MaxInt64/unit {
		return 0, fmt.Errorf("max_body '%s': want a size such as 1MiB, 512KiB or 65536 (bytes)", v)
	}
	return n * unit, nil
}

// checkCharging judges the charging subdirectives together, for the
// parser at the end of the directive and for Validate: max_debt and
// max_body only mean something with what they apply to, a handler's
// JSON paths are bounded, and a debt must be paid back within a year.
func (h *Handler) checkCharging() error {
	for _, err := range []error{checkCharge(h.Charge), checkChargeStatus(h.ChargeStatus), checkMaxDebt(h.MaxDebt), checkMaxBody(h.MaxBody)} {
		if err != nil {
			return err
		}
	}
	paths, headers := map[string]bool{}, map[string]bool{}
	charges, readsBody := false, false
	for _, c := range h.limitConfigs() {
		if !c.charges {
			continue
		}
		err := errors.Join(checkCharge(c.Charge), checkChargeStatus(c.ChargeStatus), checkMaxDebt(c.MaxDebt))
		charge, statuses, maxDebt := h.chargeOf(c.Limit)
		if err == nil && maxDebt != nil && charge == nil && statuses == nil {
			err = fmt.Errorf("max_debt '%d': nothing can run into debt without charge or charge_status; add one, or remove max_debt", *maxDebt)
		}
		if err == nil && maxDebt != nil && c.checkDebt != nil {
			err = c.checkDebt(*maxDebt)
		}
		if err != nil {
			if c.what != "" {
				return fmt.Errorf("%s %s: %w", c.what, c.Name, err)
			}
			return err
		}
		charges = charges || charge != nil || statuses != nil
		if charge != nil {
			for _, field := range charge.jsonFields() {
				for _, p := range field {
					paths[p] = true
					readsBody = true
				}
			}
			if charge.Header != "" {
				headers[http.CanonicalHeaderKey(charge.Header)] = true
			}
		}
	}
	switch {
	case len(headers) > cost.MaxHeaders:
		return fmt.Errorf("charge header: %d headers in one handler, more than %d", len(headers), cost.MaxHeaders)
	case len(paths) > scan.MaxPaths:
		return fmt.Errorf("charge json: %d paths in one handler, more than %d; sum fewer", len(paths), scan.MaxPaths)
	case h.MaxBody != 0 && !readsBody:
		return fmt.Errorf("max_body '%d': only a 'charge json' source reads the body; add one, or remove max_body", h.MaxBody)
	case h.MaxDebt != nil && !charges:
		return fmt.Errorf("max_debt '%d': nothing can run into debt without charge or charge_status; add one, or remove max_debt", *h.MaxDebt)
	}
	return nil
}

// chargeOf is how a limit charges: its own charge, charge_status and
// max_debt, else the handler's.
func (h *Handler) chargeOf(c Limit) (*Charge, []int, *int64) {
	charge, statuses, maxDebt := c.Charge, c.ChargeStatus, c.MaxDebt
	if charge == nil {
		charge = h.Charge
	}
	if statuses == nil {
		statuses = h.ChargeStatus
	}
	if maxDebt == nil {
		maxDebt = h.MaxDebt
	}
	return charge, statuses, maxDebt
}

// charging is what a handler needs to charge responses, when some limit
// charges.
type charging struct {
	cost.Sources                // what its limits read of a response
	first        *limit.Limit   // its first charging limit, which {http.rate_limit.charged} shows
	warns        *logs.Throttle // costs that could not be read: a line per 10 s
}

// setUpCharging makes each limit's charge rule and the handler's
// charging, when some limit charges (h.charging stays nil otherwise).
func (h *Handler) setUpCharging() error {
	c := &charging{Sources: cost.Sources{MaxBody: h.MaxBody}, warns: &logs.Throttle{Every: 10 * time.Second}}
	for i, config := range h.limitConfigs() {
		charge, statuses, maxDebt := h.chargeOf(config.Limit)
		if !config.charges || charge == nil && statuses == nil {
			continue
		}
		l := h.limits[i]
		how := cost.Charge{Statuses: statuses, MaxDebt: maxDebt}
		if charge != nil {
			how.Header, how.Placeholder = charge.Header, charge.Placeholder
			how.JSON, how.Weights = charge.jsonFields(), charge.jsonWeights()
		}
		rule, err := c.Add(how)
		if err != nil {
			return err
		}
		h.chargeWeights = h.chargeWeights || rule.WeightsPerRequest()
		l.Charge = rule
		if l.Name != "" {
			l.ChargedKey = "http.rate_limit.charged." + l.Name
		}
		if c.first == nil {
			c.first = l
		}
	}
	if c.first != nil {
		h.charging = c
		h.addStep(chargeStep{h})
	}
	return nil
}

// chargeStep is the step (steps.go) of a handler whose limits charge by
// the response: an admitted request's response passes through a writer
// that watches it for its cost, settled once the response has ended.
type chargeStep struct{ h *Handler }

func (s chargeStep) register(req *request) bool {
	req.chargeSettler = chargeSettler{s.h, req}
	req.charge = req.chargeWriter.Reset(req.w, &s.h.charging.Sources, &req.scanBody, &req.chargeSettler)
	req.w = req.charge
	return true
}

// finish settles a response that the writer did not settle as it passed.
func (s chargeStep) finish(r *http.Request, req *request, err error) {
	if cw := req.charge; cw != nil {
		cw.Finish(err, r.Context().Err() != nil)
	}
}

// chargeSettler settles a request's charges for the writer that watches
// its response.
type chargeSettler struct {
	h   *Handler
	req *request
}

// CostKnown is cost.Settler's: whether each charging bucket's cost is
// known.
func (s *chargeSettler) CostKnown(status int, answered bool) bool {
	for i := range s.req.Buckets {
		if rule := s.req.Buckets[i].Limit.Charge; rule != nil && !rule.KnownAt(status, answered) {
			return false
		}
	}
	return true
}

// Settle is cost.Settler's: it settles the request's response.
func (s *chargeSettler) Settle(end cost.End, cw *cost.Writer) {
	s.h.settleResponse(end, cw, s.req.repl, s.req)
}

// assignWeightPlaces gives each distinct factor with placeholders of the
// handler's requested_tokens and charge json a place in its requests'
// weight memo (cost.Memo).
func (h *Handler) assignWeightPlaces() {
	var places cost.Places
	for _, l := range h.limits {
		places.Assign(l.CostTerms)
		if l.Charge != nil {
			places.Assign(l.Charge.Weights())
		}
	}
}

// checkChargeWeights resolves, before a request is admitted, the
// factors with placeholders of the charge json of its limits, so that a
// weight out of range refuses it (500) rather than costing its response
// nothing. Settlement reads them from memo, the values judged here.
func (h *Handler) checkChargeWeights(buckets []limit.Bucket, repl *caddy.Replacer, memo *cost.Memo) error {
	for i := range buckets {
		rule := buckets[i].Limit.Charge
		if rule == nil {
			continue
		}
		if err := rule.CheckWeights(repl, memo); err != nil {
			if name := buckets[i].Limit.Name; name != "" {
				return fmt.Errorf("limit %s: charge json: %w", name, err)
			}
			return fmt.Errorf("charge json: %w", err)
		}
	}
	return nil
}
