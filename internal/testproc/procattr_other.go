//go:build !linux

package testproc

import "syscall"

func sysProcAttr() *syscall.SysProcAttr { return nil }
