package caddyproc

import "syscall"

// sysProcAttr makes the kernel SIGKILL Caddy if the test binary dies
// without running Cleanup (e.g. a go test -timeout panic).
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
