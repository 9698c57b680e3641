package redistest

import "syscall"

// sysProcAttr makes the kernel SIGKILL redis if the test binary dies
// without running Cleanup (e.g. a go test -timeout panic), so no servers
// are leaked.
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
