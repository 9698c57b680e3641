package logs

import (
	"strconv"
	"strings"
	"unicode/utf8"
)

// What messages (errors, logs, admin answers, {http.error.message}) may
// show of what they quote: a Redis address without its password, and a
// value from a request cut short, so that no client writes kilobytes into
// every log line and error page.

// maxQuoted is how many bytes of a value from a request a message quotes.
const maxQuoted = 64

// Cut is a value from a request (or an admin query) as messages quote
// it: whole up to maxQuoted bytes, else its first maxQuoted bytes
// (whole characters) with a marker that gives its length.
func Cut(v string) string {
	if len(v) <= maxQuoted {
		return v
	}
	cut := maxQuoted
	for cut > 0 && !utf8.RuneStart(v[cut]) {
		cut--
	}
	return v[:cut] + "…(" + strconv.Itoa(len(v)) + " bytes in all)"
}

// redactedPassword stands for a password in messages, as
// url.URL.Redacted writes it.
const redactedPassword = "xxxxx"

// RedactAddress is a Redis address as messages show it: the password of
// a URL's user information replaced by xxxxx, the user name kept (as
// url.URL.Redacted does). The user information runs to the last '@', as
// the Redis configuration reads addresses, so a password holding '/',
// '?', '#' or '@' is hidden whole, also in addresses that do not parse. In an address
// without a scheme, where a user name has no place, everything before
// the '@' is hidden.
func RedactAddress(a string) string {
	at := strings.LastIndexByte(a, '@')
	if at < 0 {
		return a
	}
	start := strings.Index(a, "://")
	if start < 0 || start > at {
		return redactedPassword + a[at:]
	}
	start += len("://")
	user, _, hasPassword := strings.Cut(a[start:at], ":")
	if !hasPassword {
		return a
	}
	return a[:start] + user + ":" + redactedPassword + a[at:]
}
