// package testproc manages one child process for the test harnesses that
// start real servers (redistest, caddyproc): starting it with its output
// in a log file, its PID, whether it is running, signalling it and
// waiting for it to exit (SIGTERM, then SIGKILL), and reading its log.
//
// On Linux the kernel SIGKILLs the child if the test binary dies without
// running its Cleanup (e.g. a go test -timeout panic), so none is leaked.
//
// SkipShort is where `go test -short` skips every test that needs such a
// process.
package testproc

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Process is the most recently started child process; the zero value
// has none. Its methods are safe for concurrent use.
type Process struct {
	mu     sync.Mutex
	cmd    *exec.Cmd
	exited chan struct{} // closed once cmd.Wait returns
}

// Start starts cmd in place of any earlier process and returns a channel
// closed once it has exited (cmd.ProcessState is set by then). If
// cmd.SysProcAttr is nil, it is set to kill the child with the test
// binary where the platform can.
func (p *Process) Start(cmd *exec.Cmd) (<-chan struct{}, error) {
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = sysProcAttr()
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	exited := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		close(exited)
	}()
	p.mu.Lock()
	p.cmd, p.exited = cmd, exited
	p.mu.Unlock()
	return exited, nil
}

// PID is the process ID of the most recently started process, or 0.
func (p *Process) PID() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil || p.cmd.Process == nil {
		return 0
	}
	return p.cmd.Process.Pid
}

// Running reports whether a process was started and has not exited.
func (p *Process) Running() bool {
	p.mu.Lock()
	exited := p.exited
	p.mu.Unlock()
	if exited == nil {
		return false
	}
	select {
	case <-exited:
		return false
	default:
		return true
	}
}

// Signal sends sig unless the process has already exited and reports
// whether it is gone within timeout. With no process it reports true.
func (p *Process) Signal(sig syscall.Signal, timeout time.Duration) bool {
	p.mu.Lock()
	cmd, exited := p.cmd, p.exited
	p.mu.Unlock()
	if cmd == nil {
		return true
	}
	select {
	case <-exited:
		return true
	default:
	}
	_ = cmd.Process.Signal(sig)
	select {
	case <-exited:
		return true
	case <-time.After(timeout):
		return false
	}
}

// Kill sends SIGKILL and reports whether the process is gone within timeout.
func (p *Process) Kill(timeout time.Duration) bool {
	return p.Signal(syscall.SIGKILL, timeout)
}

// Stop sends SIGTERM (a graceful shutdown) and waits up to timeout; past
// it, Stop kills the process (waiting up to timeout again) and reports
// false. Stopping a process that has exited reports true.
func (p *Process) Stop(timeout time.Duration) bool {
	if p.Signal(syscall.SIGTERM, timeout) {
		return true
	}
	p.Kill(timeout)
	return false
}

// LogTail returns the last n lines of the file, or a note saying why it
// cannot be read.
func LogTail(file string, n int) string {
	data, err := os.ReadFile(file)
	if err != nil {
		return fmt.Sprintf("(cannot read the log: %v)", err)
	}
	lines := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// FileSize is the size of the file, or 0 if it cannot be read; with
// ReadFrom it gives what a process logged since it was started.
func FileSize(path string) int64 {
	fi, err := os.Stat(path)
	if err != nil {
		return 0
	}
	return fi.Size()
}

// ReadFrom returns the file from byte off on (all of it if it is
// shorter, as after truncation).
func ReadFrom(path string, off int64) string {
	data, err := os.ReadFile(path)
	if err != nil || int64(len(data)) < off {
		return string(data)
	}
	return string(data[off:])
}

// FreePorts finds n distinct free loopback ports (listening on all at
// once so they differ) and releases them for a child process to bind.
// Another process may take one in between; callers retry on a bind error.
func FreePorts(n int) ([]int, error) {
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	ports := make([]int, 0, n)
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, fmt.Errorf("finding a free port: %w", err)
		}
		ls = append(ls, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}
