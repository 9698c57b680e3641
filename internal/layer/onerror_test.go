package layer

import (
	"context"
	"errors"
	"testing"

	"github.com/caddy-redis/ratelimit/internal/limit"
)

// answering is a store whose every take answers allowed and err.
type answering struct {
	allowed bool
	err     error
}

func (s answering) Take(context.Context, *limit.Call) (bool, error) { return s.allowed, s.err }
func (answering) Settle(*limit.Call, []limit.Settling)              {}
func (answering) Hold(*limit.Call) limit.Holding                    { return nil }
func (answering) Peek(context.Context, limit.Bucket) (limit.View, error) {
	return limit.View{}, nil
}
func (answering) Reset(context.Context, limit.Bucket) error { return nil }

// TestOnErrorDecidesWhatTheStoreBelowCouldNot: a take that fails below
// is allowed or denied without its buckets (marked failed, keeping the
// cause), an overflow when the store below is full, or taken by the
// local store when there is one; a take that succeeds below, or whose
// client left, passes as it is.
func TestOnErrorDecidesWhatTheStoreBelowCouldNot(t *testing.T) {
	down, full := errors.New("down"), limit.ErrFull
	local := answering{allowed: false}
	canceled, cancel := context.WithCancel(context.Background())
	cancel()
	for _, tc := range []struct {
		name        string
		ctx         context.Context
		below       answering
		o           OnErrorOptions
		wantAllowed bool
		wantErr     error
		wantFailure limit.Decision // 0: not failed
		wantTaken   bool
	}{
		{"answered below", context.Background(), answering{allowed: true}, OnErrorOptions{}, true, nil, 0, false},
		{"allow", context.Background(), answering{err: down}, OnErrorOptions{FailOpen: true}, true, down, limit.DecisionFailedAllowed, false},
		{"deny", context.Background(), answering{err: down}, OnErrorOptions{}, false, down, limit.DecisionFailedDenied, false},
		{"full below", context.Background(), answering{err: full}, OnErrorOptions{}, false, full, limit.DecisionOverflow, false},
		{"client left", canceled, answering{err: down}, OnErrorOptions{FailOpen: true}, false, down, 0, false},
		{"local", context.Background(), answering{err: down}, OnErrorOptions{Local: local}, false, nil, 0, true},
		{"local full", context.Background(), answering{err: down}, OnErrorOptions{Local: answering{err: full}}, true, nil, limit.DecisionFailedAllowed, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var c limit.Call
			c.Reset([]limit.Bucket{{Key: "k", Unknown: true}})
			allowed, err := OnError(tc.below, tc.o).Take(tc.ctx, &c)
			if allowed != tc.wantAllowed || err != tc.wantErr {
				t.Fatalf("allowed %v, err %v; want %v, %v", allowed, err, tc.wantAllowed, tc.wantErr)
			}
			if failed := tc.wantFailure != 0; c.Failed != failed || failed && c.Failure != tc.wantFailure {
				t.Errorf("failed %v (%v); want %v (%v)", c.Failed, c.Failure, failed, tc.wantFailure)
			}
			if taken := c.TakenBy != nil; taken != tc.wantTaken {
				t.Errorf("taken elsewhere %v, want %v", taken, tc.wantTaken)
			}
			if tc.wantTaken && (c.Admitted != limit.DecisionFallbackAllowed || c.Refused != limit.DecisionFallbackDenied || c.Buckets[0].Unknown) {
				t.Errorf("taken locally: decisions %v/%v, bucket unknown %v; want the fallback's, every bucket answered",
					c.Admitted, c.Refused, c.Buckets[0].Unknown)
			}
		})
	}
}
