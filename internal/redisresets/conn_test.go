package redisresets

import (
	"bytes"
	"io"
	"net"
	"strconv"
	"strings"
	"testing"
)

// chunkedConn is a connection whose reads return data in pieces of the
// given sizes, in turn.
type chunkedConn struct {
	net.Conn
	data   []byte
	pieces []int
	i      int
}

func (c *chunkedConn) Read(p []byte) (int, error) {
	if len(c.data) == 0 {
		return 0, io.EOF
	}
	n := copy(p, c.data[:min(len(c.data), c.pieces[c.i%len(c.pieces)])])
	c.data, c.i = c.data[n:], c.i+1
	return n, nil
}

// TestResetsConnDropsOversizedBulkStrings reads a RESP2 and RESP3 stream
// (a handshake's map, messages small and large, a null, a pong, an
// error) through the subscription's filter, in pieces of every size from
// a byte on, both on the wire and as asked: it comes out unchanged but
// for the message over MaxMessage, which is the stand-in.
func TestResetsConnDropsOversizedBulkStrings(t *testing.T) {
	bulk := func(s string) string { return "$" + strconv.Itoa(len(s)) + "\r\n" + s + "\r\n" }
	big := strings.Repeat("\n", MaxMessage+1)
	fits := strings.Repeat("k", MaxMessage)
	head := "%2\r\n" + bulk("server") + bulk("redis") + bulk("proto") + ":3\r\n" + // HELLO 3
		">3\r\n" + bulk("subscribe") + bulk("rate_limit:reset") + ":1\r\n" +
		">3\r\n" + bulk("message") + bulk("rate_limit:reset") + bulk("rate_limit:a\nrate_limit:b") +
		"*3\r\n" + bulk("message") + bulk("rate_limit:reset") + bulk(fits) +
		">3\r\n" + bulk("message") + bulk("rate_limit:reset")
	tail := ">3\r\n" + bulk("message") + bulk("rate_limit:reset") + "$-1\r\n" +
		"+PONG\r\n" + "-ERR wrong\r\n" + "=8\r\ntxt:1234\r\n" + "_\r\n"
	in := head + bulk(big) + tail
	want := head + string(oversizedBulk) + tail
	for _, wire := range []int{1, 2, 7, 4096, 1 << 20} {
		for _, ask := range []int{1, 3, 64, 32 << 10} {
			sub := &Channel{}
			c := &resetsConn{Conn: &chunkedConn{data: []byte(in), pieces: []int{wire, wire + 1}}, sub: sub}
			var out bytes.Buffer
			buf := make([]byte, ask)
			for {
				n, err := c.Read(buf)
				out.Write(buf[:n])
				if err == io.EOF {
					break
				}
				if err != nil {
					t.Fatalf("wire %d, reads of %d: %v", wire, ask, err)
				}
			}
			if got := out.String(); got != want {
				t.Fatalf("wire %d, reads of %d: %d bytes out, want %d:\n%.200q", wire, ask, len(got), len(want), got)
			}
			if sub.tooLarge.Load() != 1 || sub.lastSize.Load() != int64(len(big)) {
				t.Fatalf("wire %d, reads of %d: %d dropped (last %d bytes), want 1 of %d", wire, ask,
					sub.tooLarge.Load(), sub.lastSize.Load(), len(big))
			}
		}
	}
	// A header that is no bulk string's ends the connection.
	c := &resetsConn{Conn: &chunkedConn{data: []byte("$12x\r\n"), pieces: []int{100}}, sub: &Channel{}}
	if _, err := c.Read(make([]byte, 100)); err != errResetsProtocol {
		t.Fatalf("a malformed header: %v, want %v", err, errResetsProtocol)
	}
}
