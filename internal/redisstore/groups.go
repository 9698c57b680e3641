package redisstore

import (
	"context"
	"time"

	"github.com/caddy-redis/ratelimit/internal/limit"
)

// Cluster slot groups: on a Redis Cluster, the limits of one key
// template share a hash tag, so their keys live in one hash slot and go in
// one script call; a request whose limits span several groups takes them
// in order, and gives back what earlier groups took when a later one
// refuses.

// HashSlotGroups splits the limits by Cluster hash slot, in the order their
// key templates first appear.
func HashSlotGroups(limits []*limit.Limit) [][]*limit.Limit {
	var groups [][]*limit.Limit
	for _, l := range limits {
		if l.Group == len(groups) {
			groups = append(groups, nil)
		}
		groups[l.Group] = append(groups[l.Group], l)
	}
	return groups
}

// giveBackGroups returns what a request took from earlier slot groups, a
// script call per group (one hash slot each), whether or not the client is
// still there: the tokens must not stay taken. A failure is logged; those
// buckets then stay short until they refill.
func (s *Store) giveBackGroups(clientCtx context.Context, taken []limit.Bucket) {
	ctx := context.WithoutCancel(clientCtx)
	if s.holding {
		taken = s.releaseTaken(taken) // what is held while served goes back its own way
	}
	for start := 0; start < len(taken); {
		end := start + 1
		for end < len(taken) && taken[end].Limit.Group == taken[start].Limit.Group {
			end++
		}
		if err := s.client.giveBack(ctx, time.Now(), taken[start:end]); err != nil {
			s.report.Warn("Redis failed while giving tokens back; those buckets stay short until they refill", err)
		}
		start = end
	}
}

// takeGroups takes a request's buckets on a Cluster whose hash slots they
// span: one slot group after another, in a fixed order, each group all
// or nothing in one script call. When a later group refuses or fails,
// the earlier groups get their tokens back. A bucket given back what was
// taken, capped at its burst, is never fuller than it would have been, so
// the bound holds; a request that meets such a bucket meanwhile may be
// refused, briefly, when it would otherwise fit.
func (s *Store) takeGroups(clientCtx context.Context, r *limit.Call, sent time.Time, buckets []limit.Bucket) (bool, error) {
	var inline [limit.MaxInline]limit.Bucket
	var given [limit.MaxInline]limit.Bucket
	taken := given[:0]
	for g := range s.groups {
		group := inline[:0]
		for i := range buckets {
			if buckets[i].Limit.Group == g {
				group = append(group, buckets[i])
			}
		}
		if len(group) == 0 {
			continue
		}
		allowed, err := s.take(clientCtx, r, sent, group)
		j := 0
		for i := range buckets {
			if buckets[i].Limit.Group == g {
				buckets[i].Remaining, buckets[i].RetryAfter, buckets[i].KindN = group[j].Remaining, group[j].RetryAfter, group[j].KindN
				buckets[i].Wait = group[j].Wait
				j++
			} else if buckets[i].Limit.Group > g {
				buckets[i].Unknown = !allowed || err != nil
			}
		}
		if err == nil && allowed {
			taken = append(taken, group...)
			continue
		}
		s.giveBackGroups(clientCtx, taken)
		for i := range buckets {
			if buckets[i].Limit.Group < g {
				// Given back: it holds the request's tokens again, so its
				// wait after the take is no reason to come back later.
				// One that the request would have waited for holds them
				// when the request would have gone on (its remaining
				// stays the take's 0, at most what it holds).
				if buckets[i].Wait > 0 {
					buckets[i].RetryAfter, buckets[i].Wait = buckets[i].Wait, 0
					continue
				}
				buckets[i].Remaining += buckets[i].Values.Requested
				buckets[i].RetryAfter = 0
			}
		}
		return false, err
	}
	return true, nil
}
