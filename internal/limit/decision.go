package limit

// Decision is what the limiter decided for a request; it labels the
// metrics and fills {http.rate_limit.result}.
type Decision uint8

const (
	DecisionAllowed         Decision = iota // tokens taken
	DecisionDenied                          // a bucket short (or burst_capacity 0)
	DecisionExempt                          // the rate resolved to `unlimited`
	DecisionInvalid                         // a value from the request out of range
	DecisionEmptyKey                        // the key resolved to nothing
	DecisionFailedAllowed                   // the store failed; the fallback allowed it
	DecisionFailedDenied                    // the store failed; the fallback denied it
	DecisionShadowDenied                    // would be denied; shadow mode let it pass
	DecisionOverflow                        // the store full: a new client's request is decided without its buckets
	DecisionFallbackAllowed                 // the store failed; the fallback's buckets admitted it
	DecisionFallbackDenied                  // the store failed; the fallback's buckets refused it
	DecisionWaited                          // tokens taken for a later moment; the request waited until then (max_wait)
	DecisionLeftWaiting                     // the client left while the request waited; its tokens were given back
	NumDecisions
)

var decisionNames = [NumDecisions]string{"allowed", "denied", "exempt", "invalid", "empty_key", "error_allowed",
	"error_denied", "shadow_denied", "overflow", "error_local_allowed", "error_local_denied", "waited", "left_waiting"}

func (d Decision) String() string { return decisionNames[d] }

// DecisionValues are the decisions as placeholder values, boxed once (1
// alloc per request: BenchmarkServeHTTPAllowed 17 -> 16).
var DecisionValues = func() (v [NumDecisions]any) {
	for d := range NumDecisions {
		v[d] = d.String()
	}
	return v
}()
