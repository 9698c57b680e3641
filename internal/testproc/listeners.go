package testproc

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"
)

// Listeners are TCP sockets listening on some ports, by inode.
type Listeners map[uint64]bool

// ListenersOn returns the sockets listening now on any of the ports (on
// any address), as the kernel lists them in /proc/net/tcp and tcp6; ok
// is false where those cannot be read (not Linux).
//
// Caddy listens with SO_REUSEPORT: a config load opens the new config's
// sockets beside the old ones, and POST /load returns before the old
// ones are closed (the goroutine that closes them may not have run yet,
// and a socket closes only once its accept has returned). Until then a
// new connection may land on an old socket: the old config answers it,
// or the socket closes with it in its backlog (a reset). AwaitClosed on
// the sockets found before a load waits that out.
func ListenersOn(ports ...int) (l Listeners, ok bool) {
	l = Listeners{}
	for _, table := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
		f, err := os.Open(table)
		if err != nil {
			return nil, false
		}
		s := bufio.NewScanner(f)
		for s.Scan() {
			// sl local_address rem_address st ... uid timeout inode
			fields := strings.Fields(s.Text())
			if len(fields) < 10 || fields[3] != "0A" { // 0A: LISTEN
				continue
			}
			_, hexPort, _ := strings.Cut(fields[1], ":")
			port, err1 := strconv.ParseUint(hexPort, 16, 16)
			inode, err2 := strconv.ParseUint(fields[9], 10, 64)
			if err1 != nil || err2 != nil {
				continue
			}
			for _, p := range ports {
				if int(port) == p {
					l[inode] = true
				}
			}
		}
		f.Close()
	}
	return l, true
}

// AwaitClosed waits until none of the sockets in l listens on any of the
// ports, or fails after timeout.
func (l Listeners) AwaitClosed(timeout time.Duration, ports ...int) error {
	deadline := time.Now().Add(timeout)
	for {
		now, ok := ListenersOn(ports...)
		if !ok {
			return nil
		}
		open := 0
		for inode := range now {
			if l[inode] {
				open++
			}
		}
		if open == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%d socket(s) of the config before the load still listen on %v after %v", open, ports, timeout)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
