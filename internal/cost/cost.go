// package cost reads what a response cost a limit that charges by it:
// the charge rule of each limit (a header, JSON paths of the body with
// their weights, a placeholder, the statuses charged, its debt), the
// writer that watches a response for it (writer.go), the weighted sums
// of requested_tokens and charge json (weights.go) and their exact
// decimal arithmetic (amount.go). Settling a cost in a store is the
// handler's.
package cost

import (
	"errors"
	"fmt"
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"

	"github.com/caddy-redis/ratelimit/internal/scan"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// Bounds of a cost: token counts stay exact in the scripts' doubles, and
// a debt is paid back within a year (what Retry-After can say).
const (
	MaxTokens      = 1 << 53
	MaxFillSeconds = 365 * 86400
)

// Bounds of what a response's charge holds: the cost headers of a
// handler (its JSON paths and their keys are bounded by scan.MaxPaths and
// scan.MaxKeys).
const (
	MaxHeaders      = 4
	chargeValueShow = 64 // bytes of a cost value a warning quotes
)

// Sources are what a handler's charging limits read of its responses:
// the cost headers and JSON paths of all of them, which a Writer
// watches, and the most bytes of a body it scans.
type Sources struct {
	// MaxBody is the most bytes of a body a scan reads; 0: all.
	MaxBody int64
	headers []string // every cost header its limits read, canonical
	paths   scan.Paths
}

// Charge says how one limit charges, as its config says: where its cost
// comes from (at most one of Header, JSON and Placeholder; none: its
// reservation), the statuses charged and its debt.
type Charge struct {
	// Header is a response header (or trailer) whose value is the cost.
	Header string
	// JSON are the paths of the body's numbers by field: a field is one
	// number, the last found at any of its paths; the fields are summed.
	JSON [][]string
	// Weights are each field's term as written, `<path>*<weight>...`
	// (judged by CheckJSONTerm before), or nil when no term has weights.
	Weights []string
	// Placeholder is read once the response is written.
	Placeholder string
	// Statuses are the statuses charged: codes, or classes (2 for 2xx);
	// empty, every status.
	Statuses []int
	// MaxDebt is max_debt; nil, the bucket's burst.
	MaxDebt *int64
}

// Rule is how one limit charges, ready for requests.
type Rule struct {
	header      string   // canonical, for charge header
	trailer     string   // http.TrailerPrefix and header: an undeclared trailer's key
	headerIndex int      // its index in the handler's Sources.headers
	paths       uint16   // for charge json: bits of the handler's scan paths
	fields      []uint16 // the bits of each field (of each path of JSON)
	weights     []Term   // with weights: each field's (weights.go); nil without
	placeholder string
	statuses    []int // empty: every status
	// maxDebt is max_debt; -1 when it is the bucket's burst. maxArg is it
	// as the script's argument, boxed once (when set).
	maxDebt int64
	maxArg  any
}

// Add makes the rule of a limit that charges so, and adds its header and
// JSON paths to those s reads.
func (s *Sources) Add(c Charge) (*Rule, error) {
	rule := &Rule{statuses: c.Statuses, maxDebt: -1, placeholder: c.Placeholder}
	if c.MaxDebt != nil {
		rule.maxDebt, rule.maxArg = *c.MaxDebt, strconv.FormatInt(*c.MaxDebt, 10)
	}
	if c.Header != "" {
		rule.header = http.CanonicalHeaderKey(c.Header)
		rule.trailer = http.TrailerPrefix + rule.header
		rule.headerIndex = slices.Index(s.headers, rule.header)
		if rule.headerIndex < 0 {
			rule.headerIndex = len(s.headers)
			s.headers = append(s.headers, rule.header)
		}
	}
	for _, field := range c.JSON {
		var bits uint16
		for _, p := range field {
			bit, err := s.paths.Add(p)
			switch {
			case errors.Is(err, scan.ErrTooManyPaths): // the handler's checks refused it first
				return nil, fmt.Errorf("charge json: more than %d paths in one handler; sum fewer", scan.MaxPaths)
			case err != nil:
				return nil, fmt.Errorf("charge json '%s': %w", p, err)
			}
			bits |= bit
		}
		rule.paths |= bits
		rule.fields = append(rule.fields, bits)
	}
	for _, term := range c.Weights {
		_, _, t, _ := compileChargeTerm("charge json", term) // judged by CheckJSONTerm
		rule.weights = append(rule.weights, t)
	}
	return rule, nil
}

// ReadsJSON says whether the rule reads the cost from the body's JSON.
func (r *Rule) ReadsJSON() bool { return r.paths != 0 }

// Weights are the rule's weighted terms, a field's each (nil without
// weights), for Places to give their factors a place.
func (r *Rule) Weights() []Term { return r.weights }

// WeightsPerRequest says whether some weight of the rule has
// placeholders, which CheckWeights resolves before a request is
// admitted.
func (r *Rule) WeightsPerRequest() bool {
	for i := range r.weights {
		if r.weights[i].factors != nil {
			return true
		}
	}
	return false
}

// CheckWeights resolves, before a request is admitted, the factors with
// placeholders of the rule's weights, so that a weight out of range
// refuses it (500) rather than costing its response nothing.
// Settlement reads them from memo, the values judged here.
func (r *Rule) CheckWeights(repl *caddy.Replacer, memo *Memo) error {
	for j := range r.weights {
		for k := range r.weights[j].factors {
			if _, err := memo.value(&r.weights[j].factors[k], chargeValueParam, repl); err != nil {
				return err
			}
		}
	}
	return nil
}

// Cost is what a response that ended so costs a limit whose reservation
// was reserved: nothing when it answered a status not charged, else what
// the source says, or the reservation without a source. why says why the
// source could not be read (the reservation is the cost then). A
// response cut short costs at least its reservation: a client must not
// pay less by leaving.
func (r *Rule) Cost(end End, cw *Writer, repl *caddy.Replacer, memo *Memo, reserved int64) (cost int64, why string) {
	if end.Status != 0 && !r.Charges(end.Status) {
		return 0, ""
	}
	switch {
	case end.Status == http.StatusSwitchingProtocols && r.paths != 0:
		return reserved, "" // an upgraded connection has no body to read
	case r.header != "":
		value, ok := cw.costHeader(r)
		if !ok {
			cost, why = reserved, "no "+r.header+" header"
			break
		}
		cost, why = parseCost(value)
		if why != "" {
			why = "header " + r.header + " " + why
		}
	case r.placeholder != "":
		cost, why = parseCost(repl.ReplaceAll(r.placeholder, ""))
		if why != "" {
			why = "placeholder " + r.placeholder + " " + why
		}
	case r.paths != 0:
		if _, why = cw.body.Sum(r.fields...); why == "" {
			cost, why = r.jsonCost(cw, repl, memo)
		}
	default:
		return reserved, ""
	}
	switch {
	case end.CutShort && (why != "" || cost < reserved):
		return reserved, "" // what it reported so far, if more
	case why != "":
		return reserved, why
	}
	return cost, ""
}

// jsonCost is the sum of a body's fields, each times its weight when
// the charge has weights, in exact decimals (amount.go), rounded up. A
// field not in the body counts 0. The weights with placeholders are
// those the request's check resolved (memo), not resolved again. Sum
// judged the body first: a field here is a number, 0 or more.
func (r *Rule) jsonCost(cw *Writer, repl *caddy.Replacer, memo *Memo) (cost int64, why string) {
	var sum amount
	for i, f := range r.fields {
		v, ok := cw.body.Field(f)
		if !ok {
			continue
		}
		a := amountOfFloat(v)
		if r.weights != nil {
			w, err := r.weights[i].product(chargeValueParam, repl, memo)
			if err != nil {
				return 0, err.Error()
			}
			a = a.mul(w)
		}
		sum = sum.add(a)
	}
	return sum.ceil(), ""
}

// Charges says whether a response that answered status is charged: every
// status without charge_status. An upgrade (101, a WebSocket) is the
// success of its request: a 2xx class charges it, as 101 and 1xx do.
func (r *Rule) Charges(status int) bool {
	if len(r.statuses) == 0 {
		return true
	}
	for _, s := range r.statuses {
		if caddyhttp.StatusCodeMatches(status, s) || status == http.StatusSwitchingProtocols && s == 2 {
			return true
		}
	}
	return false
}

// KnownAt says whether the cost is known from a response's status on
// (answered: and from the end of its answer in the body on).
func (r *Rule) KnownAt(status int, answered bool) bool {
	switch {
	case !r.Charges(status):
		return true // nothing
	case r.header != "" || r.placeholder != "":
		return false // a trailer or the placeholder may come last
	case r.paths != 0:
		return answered || status == http.StatusSwitchingProtocols
	}
	return true // the reservation
}

// MaxDebt is how far below zero a bucket of burst and rate may go: its
// max_debt, or its burst; never more than a year's refill, so a debt is
// always paid back within what Retry-After can say.
func (r *Rule) MaxDebt(burst int64, rate float64) int64 {
	debt := int64(-1) // no rule (a limit that does not charge, given back a request's tokens): the default
	if r != nil {
		debt = r.maxDebt
	}
	if debt < 0 {
		debt = burst
	}
	if rate == 0 { // a limit without a rate: its debt ends with its period
		return debt
	}
	return min(debt, int64(rate*MaxFillSeconds))
}

// MaxDebtArg is MaxDebt as the settle script's argument: boxed once
// when it is max_debt or the burst (burstArg, the bucket's argument).
func (r *Rule) MaxDebtArg(burst int64, rate float64, burstArg any) any {
	switch debt := r.MaxDebt(burst, rate); {
	case r != nil && debt == r.maxDebt:
		return r.maxArg
	case debt == burst:
		return burstArg
	default:
		return strconv.FormatInt(debt, 10)
	}
}

// parseCost reads a cost: a number of tokens, not negative, rounded up.
func parseCost(text string) (int64, string) {
	v, err := strconv.ParseFloat(strings.TrimSpace(text), 64)
	switch {
	case err != nil || math.IsNaN(v) || math.IsInf(v, 0):
		return 0, fmt.Sprintf("'%s' is not a number", cutShort(text))
	case v < 0:
		return 0, fmt.Sprintf("'%s' is negative", cutShort(text))
	}
	return ceilTokens(v), ""
}

// ceilTokens rounds a cost up to whole tokens, at most 2^53.
func ceilTokens(v float64) int64 {
	return int64(math.Min(math.Ceil(v), MaxTokens))
}

// cutShort cuts a value from a response to what a log line quotes.
func cutShort(s string) string {
	if len(s) <= chargeValueShow {
		return s
	}
	return s[:chargeValueShow] + "..."
}
