package lease

import "time"

// What the handler's tests read of its leases and do to them, beside
// requests: the package's own tests reach the leases directly.

// MaxTokens is the most tokens one lease holds.
func (ls *Leases) MaxTokens() int64 { return ls.max }

// Hold is how long a lease admits requests after a call.
func (ls *Leases) Hold() time.Duration { return ls.hold }

// ID names this instance in the buckets' lease records.
func (ls *Leases) ID() string { return ls.id }

// Held is what the lease on the bucket at key holds (0: none).
func (ls *Leases) Held(key string) int64 {
	sh := &ls.shards[ls.shardIndex(key)]
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if l := sh.byKey[key]; l != nil {
		return l.tokens
	}
	return 0
}

// Until is when the hold of the lease on the bucket at key ends (zero:
// no lease).
func (ls *Leases) Until(key string) time.Time {
	sh := &ls.shards[ls.shardIndex(key)]
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if l := sh.byKey[key]; l != nil {
		return l.until
	}
	return time.Time{}
}

// Counted is what the leases that Redis counts hold, and how many they are.
func (ls *Leases) Counted() (tokens int64, n int) {
	ls.each(func(l *lease) {
		if l.counted {
			tokens += l.tokens
			n++
		}
	})
	return tokens, n
}

// Entries is how many buckets the leases know (a lease each).
func (ls *Leases) Entries() (n int) {
	ls.each(func(*lease) { n++ })
	return n
}

// Flying says whether a call of the leases is in flight.
func (ls *Leases) Flying() (flying bool) {
	ls.each(func(l *lease) { flying = flying || l.flight != nil })
	return flying
}

// each calls f with every lease, its shard locked.
func (ls *Leases) each(f func(*lease)) {
	for i := range ls.shards {
		sh := &ls.shards[i]
		sh.mu.Lock()
		for _, l := range sh.byKey {
			f(l)
		}
		sh.mu.Unlock()
	}
}

// PickGiveBacks picks the leases whose hold ended by now, as the
// give-back loop does, and returns how many it picked and the give-back
// of them, to send when the caller says.
func (ls *Leases) PickGiveBacks(now time.Time) (n int, giveBack func()) {
	back, seq := ls.take(now, false)
	return back.len(), func() { ls.giveBackLeases(back, seq) }
}
