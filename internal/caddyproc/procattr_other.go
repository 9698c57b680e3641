//go:build !linux

package caddyproc

import "syscall"

func sysProcAttr() *syscall.SysProcAttr { return nil }
