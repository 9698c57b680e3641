package requestbody

import (
	"bytes"
	"io"
	"net/http"
	"strconv"
	"sync"
)

// What a Reader read of a body, given to the next handler ahead of the
// rest, and the body's size as its size placeholder gives it.

// Replay is a request body whose first bytes were read: it gives those,
// then the rest. Its buffer goes back to the pool once given out, at
// Close, or at Done.
type Replay struct {
	mu     sync.Mutex // a Close from another goroutine than Read's (the proxy's transport)
	rest   []byte     // of the bytes read, those not given out yet
	pooled *[]byte    // rest's buffer, when it came from the pool
	body   io.ReadCloser
	size   int // the bytes read; never changes
}

// String is the size of the body read, in bytes: the value of the size
// placeholder for a body read to its end without Content-Length,
// formatted only when a placeholder asks.
func (b *Replay) String() string { return strconv.Itoa(b.size) }

// contentLength is the request's Content-Length as text: its header's
// own when written as the number is, which most are (1 alloc less per
// request: BenchmarkServeHTTPLLM/llm 20 -> 19).
func contentLength(r *http.Request) string {
	if v := r.Header["Content-Length"]; len(v) == 1 && isCanonicalCount(v[0]) {
		if n, err := strconv.ParseInt(v[0], 10, 64); err == nil && n == r.ContentLength {
			return v[0]
		}
	}
	return strconv.FormatInt(r.ContentLength, 10)
}

// isCanonicalCount says whether s is a whole number as strconv writes
// it: digits, without a leading zero.
func isCanonicalCount(s string) bool {
	if s == "" || s[0] == '0' && len(s) > 1 {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return true
}

// Read gives the bytes read before, then the rest of the body.
func (b *Replay) Read(p []byte) (int, error) {
	b.mu.Lock()
	if len(b.rest) > 0 {
		n := copy(p, b.rest)
		b.rest = b.rest[n:]
		if len(b.rest) == 0 {
			b.release()
		}
		b.mu.Unlock()
		return n, nil
	}
	b.mu.Unlock()
	return b.body.Read(p)
}

// Close closes the body; what was read before and not given out is
// dropped.
func (b *Replay) Close() error {
	b.mu.Lock()
	b.rest = nil
	b.release()
	b.mu.Unlock()
	return b.body.Close()
}

// Done is called once the handlers after the Reader's caller returned:
// the buffer goes back to the pool, and what was not given out yet (a
// handler that did not read the body, or a proxy's transport still
// sending it) is kept in a copy of its own.
func (b *Replay) Done() {
	b.mu.Lock()
	if b.pooled != nil && len(b.rest) > 0 {
		b.rest = bytes.Clone(b.rest)
	}
	b.release()
	b.mu.Unlock()
}

// release gives the buffer back to the pool, once; b.mu is held.
func (b *Replay) release() {
	if b.pooled != nil {
		requestBuffers.Put(b.pooled)
		b.pooled = nil
	}
}
