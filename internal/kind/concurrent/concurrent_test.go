package concurrent

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/limit"
)

func TestResolveValuesReadsSlotsInTheBurstsPlace(t *testing.T) {
	k := New(30*time.Second, time.Second)
	for _, tc := range []struct {
		slots     string
		want      limit.Values
		unlimited bool
		err       string
	}{
		{"5", limit.Values{Burst: 5, Requested: 1}, false, ""},
		{"0", limit.Values{Burst: 0, Requested: 1}, false, ""},
		{"9007199254740992", limit.Values{Burst: 1 << 53, Requested: 1}, false, ""},
		{"unlimited", limit.Values{}, true, ""},
		{"9007199254740993", limit.Values{}, false, "slots '9007199254740993' is not a whole number"},
		{"-1", limit.Values{}, false, "slots '-1' is not a whole number"},
		{"2.5", limit.Values{}, false, "slots '2.5' is not a whole number"},
	} {
		v, unlimited, err := k.ResolveValues("", tc.slots, "ignored")
		if tc.err != "" {
			var pe *limit.ParamError
			if !errors.As(err, &pe) || pe.Param != "slots" || !strings.HasPrefix(err.Error(), tc.err) {
				t.Errorf("%s: error %v, want %q", tc.slots, err, tc.err)
			}
			continue
		}
		if err != nil || unlimited != tc.unlimited || v != tc.want {
			t.Errorf("%s: %+v, %v, %v; want %+v, %v", tc.slots, v, unlimited, err, tc.want, tc.unlimited)
		}
	}
}

func TestResolveValuesReadsPriorityInTheRatesPlaceAndItsMaxWait(t *testing.T) {
	k := New(30*time.Second, time.Second).WithMaxWait(5 * time.Second)
	for _, tc := range []struct {
		priority string
		want     int64
		err      string
	}{
		{"", 0, ""}, {"0", 0, ""}, {"10", 10, ""}, {"-7", -7, ""},
		{"1000000", 1000000, ""}, {"-1000000", -1000000, ""},
		{"1000001", 0, "priority '1000001' is not a whole number"},
		{"1.5", 0, "priority '1.5' is not a whole number"},
		{"high", 0, "priority 'high' is not a whole number"},
	} {
		v, _, err := k.ResolveValues(tc.priority, "4", "")
		if tc.err != "" {
			var pe *limit.ParamError
			if !errors.As(err, &pe) || pe.Param != "priority" || !strings.HasPrefix(err.Error(), tc.err) {
				t.Errorf("%q: error %v, want %q", tc.priority, err, tc.err)
			}
			continue
		}
		want := limit.Values{Burst: 4, Requested: 1, MaxWait: 5 * time.Second, Priority: tc.want}
		if err != nil || v != want {
			t.Errorf("%q: %+v, %v; want %+v", tc.priority, v, err, want)
		}
	}
	if k.RateName() != "priority" {
		t.Errorf("rate name %q", k.RateName())
	}
	b, _ := k.Begin(limit.Bucket{Args: k.ScriptArgs(limit.Values{Burst: 4}), Values: limit.Values{Burst: 4, Priority: -3}}, limit.Shared{})
	got := k.AppendQueueArgs(nil, b, "chan")
	if len(got) != 6 || got[0] != "cq" || got[1] != "4" || got[2] != b.Args[2] || got[3] != "30000000" || got[4] != "-3" || got[5] != "chan" {
		t.Errorf("queue arguments %v", got)
	}
}

func TestBeginGivesARequestsBucketsOneIDAndEachRequestItsOwn(t *testing.T) {
	k := New(30*time.Second, time.Second)
	args := k.ScriptArgs(limit.Values{Burst: 7, Requested: 1})
	var shared limit.Shared
	a, shared := k.Begin(limit.Bucket{Args: args}, shared)
	b, shared := k.Begin(limit.Bucket{Args: args}, shared)
	id, ok := a.Args[2].(*string)
	if !ok || a.Args[2] != b.Args[2] || shared.ID != a.Args[2] {
		t.Fatalf("ids %v and %v, shared %v: want one *string", a.Args[2], b.Args[2], shared.ID)
	}
	other, _ := k.Begin(limit.Bucket{Args: args}, limit.Shared{})
	if *other.Args[2].(*string) == *id {
		t.Errorf("two requests have the slot id %q", *id)
	}
	if !strings.HasPrefix(*id, instanceID+":") {
		t.Errorf("slot id %q does not start with the instance's %q", *id, instanceID)
	}
	got := k.AppendArgs(nil, a)
	if len(got) != 4 || got[0] != "c" || got[1] != "7" || got[2] != a.Args[2] || got[3] != "30000000" {
		t.Errorf("arguments %v, want c, 7, the id, 30000000", got)
	}
}

func TestRefusedWaitsRetryAfterOnlyWhenFull(t *testing.T) {
	k := New(time.Minute, 3*time.Second)
	if hold, arg := k.HoldFor(); hold != time.Minute || arg != "60000000" {
		t.Errorf("hold %v, %v; want 1m0s, 60000000", hold, arg)
	}
	if b := k.Refused(limit.Bucket{Remaining: 0}); b.RetryAfter != 3*time.Second {
		t.Errorf("a full bucket waits %v, want 3s", b.RetryAfter)
	}
	if b := k.Refused(limit.Bucket{Remaining: 2}); b.RetryAfter != 0 {
		t.Errorf("a bucket with room waits %v, want 0", b.RetryAfter)
	}
	if b := k.Refused(limit.Bucket{Remaining: 0, Unknown: true}); b.RetryAfter != 0 {
		t.Errorf("a bucket a layer knows nothing of waits %v, want 0", b.RetryAfter)
	}
	f := k.Facts(limit.Bucket{Values: limit.Values{Burst: 4, Requested: 1}, RetryAfter: 3 * time.Second})
	if f != (limit.Facts{Burst: 4, Requested: 1, Unit: "concurrent-requests", Reset: 3 * time.Second}) {
		t.Errorf("facts %+v", f)
	}
}

func TestAdminViewShowsSlotsHoldAndExpiries(t *testing.T) {
	k := New(30*time.Second, time.Second)
	l := &limit.Limit{Name: "c", KeyText: "{client_ip}", Burst: "4", KeyPrefix: "p:", KeySuffix: ":slots"}
	li, err := json.Marshal(k.LimitInfo(l))
	if err != nil || !strings.Contains(string(li), `"ipv6_prefix":0,"slots":4,"hold":"30s"}`) {
		t.Errorf("limit info %s, %v", li, err)
	}
	b := limit.Bucket{Limit: l, Key: "p:1.2.3.4:slots", Values: limit.Values{Burst: 4, Requested: 1}}
	bi, err := json.Marshal(k.BucketInfo(b, limit.View{InUse: 2, Expiries: []time.Duration{time.Second, 2500 * time.Millisecond}}))
	want := `{"limit":"c","key":"1.2.3.4","stored_key":"p:1.2.3.4:slots","retry_after":0,"expires_in":0,"slots":4,"in_use":2,"slot_expires_in":[1,2.5]}`
	if err != nil || string(bi) != want {
		t.Errorf("bucket info %s, %v; want %s", bi, err, want)
	}
}
