package redisbatch

import (
	"fmt"
	"sync"
)

// MergedKind is a kind of call that the batcher joins into one script
// call per batch, on one Redis server (not a Cluster, where the keys of
// one call must share a slot): its script answers each key on its own,
// so one call does for all of them what one call each would, at less
// cost to Redis and this instance. Each call gets its part of the
// answer; the node's breaker counts them as one call.
type MergedKind struct {
	Name   string // in the error of a reply too short for its parts
	Script *Script
	Lead   []any // the script's own arguments, before the keys' ones
	Width  int   // values of the reply per key
	Is     func(c *Call) bool
}

// merge joins the calls of kind in send into one where the first of them
// stands, without changing what any call sees: a call of kind joins only
// when no call between the first and it has one of its keys (it then
// runs before those calls, which it does not touch); else it starts
// another merged call where it stands. Their parts keep their order.
func (b *Batcher) merge(send []*Call, kind *MergedKind) []*Call {
	if b.cluster != nil {
		return send
	}
	out := send[:0] // never longer than what has been read of send
	first := -1     // where the open merged call stands in out
	var open *mergedCall
	for _, c := range send {
		switch {
		case !kind.Is(c):
			out = append(out, c)
			continue
		case first >= 0 && !anyKeyOf(out[first+1:], c.Keys):
			if open == nil {
				open = mergedCalls.Get().(*mergedCall)
				open.parts = append(open.parts, out[first])
			}
			open.parts = append(open.parts, c)
			continue
		}
		if open != nil {
			out[first], open = open.call(kind), nil
		}
		first = len(out)
		out = append(out, c)
	}
	if open != nil {
		out[first] = open.call(kind)
	}
	return out
}

// call is the one call that sends the parts.
func (m *mergedCall) call(kind *MergedKind) *Call {
	m.kind = kind
	c := NewCall()
	for _, p := range m.parts {
		c.Keys = append(c.Keys, p.Keys...)
	}
	c.Command(kind.Script)
	c.Args = append(c.Args, kind.Lead...)
	for _, p := range m.parts {
		c.Args = append(c.Args, p.Args[3+len(p.Keys)+len(kind.Lead):]...) // after evalsha, sha, count, keys and lead
	}
	first := m.parts[0]
	c.ClientCtx, c.breaker, c.Deadline, c.Then = first.ClientCtx, first.breaker, first.Deadline, m
	return c
}

// mergedCall is the calls that one merged call sends (pooled).
type mergedCall struct {
	kind  *MergedKind
	parts []*Call
}

var mergedCalls = sync.Pool{New: func() any { return new(mergedCall) }}

// TakeAnswer hands each call its part of the merged call's answer.
func (m *mergedCall) TakeAnswer(c *Call) {
	off := 0
	for _, p := range m.parts {
		n := m.kind.Width * len(p.Keys)
		switch p.Err = c.Err; {
		case c.Err != nil:
		case off+n > len(c.Reply):
			p.Err = fmt.Errorf("unexpected %s reply %v", m.kind.Name, c.Reply)
		default:
			p.Reply = append(p.Reply[:0], c.Reply[off:off+n]...)
		}
		off += n
		p.Answer()
	}
	c.Release()
	clear(m.parts)
	m.kind, m.parts = nil, m.parts[:0]
	mergedCalls.Put(m)
}
