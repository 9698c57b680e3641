package logs

import (
	"strings"
	"testing"
	"unicode/utf8"
)

func TestCutQuotesSixtyFourBytesAndTheLength(t *testing.T) {
	for _, c := range []struct{ name, value, want string }{
		{"short", "abc", "abc"},
		{"64 bytes", strings.Repeat("a", 64), strings.Repeat("a", 64)},
		{"65 bytes", strings.Repeat("a", 65), strings.Repeat("a", 64) + "…(65 bytes in all)"},
		{"16 KiB", strings.Repeat("7", 16384), strings.Repeat("7", 64) + "…(16384 bytes in all)"},
		// A character across byte 64 is left out whole.
		{"multibyte", strings.Repeat("a", 63) + "é" + "b", strings.Repeat("a", 63) + "…(66 bytes in all)"},
	} {
		got := Cut(c.value)
		if got != c.want || !utf8.ValidString(got) {
			t.Errorf("%s: %q, want %q", c.name, got, c.want)
		}
	}
}
