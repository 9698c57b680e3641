package testproc

import "syscall"

// sysProcAttr makes the kernel SIGKILL the child if the test binary dies
// without running Cleanup (e.g. a go test -timeout panic), so no process
// is leaked.
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
