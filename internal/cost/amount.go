package cost

import (
	"math"
	"math/bits"
	"strconv"
)

// Amounts of weighted sums in decimal: `{max_tokens}*0.07` with 100 is
// 7, not binary floating point's 7.000000000000001 rounded up to 8. An
// amount is exact while its digits fit 64 bits, which every price and
// count a config or an API writes does; past that (more than 18
// significant digits, a number beyond 10^18, a product of those) it is
// a float64, whose sum is far past what a bucket holds or past what the
// last digit changes. Nothing here allocates.

// amount is a number of a weighted sum, 0 or more: exactly
// mant / 10^scale, or about f when inexact.
type amount struct {
	mant    int64
	f       float64
	scale   int8 // 0 to maxScale digits after the point
	inexact bool
}

// maxScale is the most digits after the point an exact amount holds:
// 10^18 fits an int64.
const maxScale = 18

var pow10 = func() (p [maxScale + 1]int64) {
	p[0] = 1
	for i := 1; i <= maxScale; i++ {
		p[i] = p[i-1] * 10
	}
	return p
}()

func (a amount) float() float64 {
	if a.inexact {
		return a.f
	}
	return float64(a.mant) / float64(pow10[a.scale])
}

func (a amount) isZero() bool {
	if a.inexact {
		return a.f == 0
	}
	return a.mant == 0
}

// trim drops the zeros at the end of an exact amount's digits, so that
// its scale stays as small as its value allows.
func (a amount) trim() amount {
	for !a.inexact && a.scale > 0 && a.mant%10 == 0 {
		a.mant /= 10
		a.scale--
	}
	return a
}

// mulPow10 is m × 10^k, and whether it fits an int64.
func mulPow10(m int64, k int) (int64, bool) {
	if k > maxScale {
		return 0, m == 0
	}
	hi, lo := bits.Mul64(uint64(m), uint64(pow10[k]))
	return int64(lo), hi == 0 && lo <= math.MaxInt64
}

// mul is a × b: exact when both are and the product's digits fit. A
// product with 0 is 0, whatever the other (also a float that
// overflowed to infinity: 1e308 × 10 × 0 is 0, not NaN).
func (a amount) mul(b amount) amount {
	if a.isZero() || b.isZero() {
		return amount{}
	}
	if !a.inexact && !b.inexact && int(a.scale)+int(b.scale) <= maxScale {
		hi, lo := bits.Mul64(uint64(a.mant), uint64(b.mant))
		if hi == 0 && lo <= math.MaxInt64 {
			return amount{mant: int64(lo), scale: a.scale + b.scale}.trim()
		}
	}
	return amount{f: a.float() * b.float(), inexact: true}
}

// add is a + b: exact when both are and the sum's digits fit.
func (a amount) add(b amount) amount {
	if !a.inexact && !b.inexact {
		if a.scale < b.scale {
			a, b = b, a
		}
		if m, ok := mulPow10(b.mant, int(a.scale-b.scale)); ok && m <= math.MaxInt64-a.mant {
			return amount{mant: a.mant + m, scale: a.scale}.trim()
		}
	}
	return amount{f: a.float() + b.float(), inexact: true}
}

// ceil is the amount rounded up to whole tokens, at most 2^53.
func (a amount) ceil() int64 {
	if a.inexact {
		return ceilTokens(a.f)
	}
	p := pow10[a.scale]
	q := a.mant / p
	if a.mant%p != 0 {
		q++
	}
	return min(q, MaxTokens)
}

// amountOfFloat is a number read from a response body (the scan keeps
// float64s) as the shortest decimal that reads back as it: what the body
// wrote, for numbers of up to 15 significant digits (1.5, 0.1, 350).
func amountOfFloat(v float64) amount {
	if v >= 0 && v < 1<<53 && v == math.Trunc(v) {
		return amount{mant: int64(v)} // a count of tokens: the usual case
	}
	var buf [32]byte
	if a, ok := decimalOf(strconv.AppendFloat(buf[:0], v, 'g', -1, 64)); ok {
		return a
	}
	return amount{f: v, inexact: true}
}

// decimalOf reads a decimal number, 0 or more, as strconv.ParseFloat
// would (`12`, `0.07`, `.5`, `2.5e3`, `+1`), exactly: false when it is
// written otherwise (a hexadecimal float, `inf`, a sign '-') or its
// digits do not fit an int64 with at most maxScale after the point.
func decimalOf[T string | []byte](s T) (amount, bool) {
	i, n := 0, len(s)
	if i < n && s[i] == '+' {
		i++
	}
	var mant int64
	scale, digits := 0, 0
	point := false
	for ; i < n; i++ {
		c := s[i]
		switch {
		case c == '.' && !point:
			point = true
			continue
		case c < '0' || c > '9':
		default:
			d := int64(c - '0')
			if mant > (math.MaxInt64-d)/10 {
				return amount{}, false
			}
			mant = mant*10 + d
			digits++
			if point {
				scale++
			}
			continue
		}
		break
	}
	if digits == 0 {
		return amount{}, false
	}
	if i < n && (s[i] == 'e' || s[i] == 'E') {
		i++
		negative := false
		if i < n && (s[i] == '+' || s[i] == '-') {
			negative = s[i] == '-'
			i++
		}
		exp, expDigits := 0, 0
		for ; i < n && s[i] >= '0' && s[i] <= '9'; i++ {
			if exp < 10000 {
				exp = exp*10 + int(s[i]-'0')
			}
			expDigits++
		}
		if expDigits == 0 {
			return amount{}, false
		}
		if negative {
			exp = -exp
		}
		scale -= exp
	}
	if i != n {
		return amount{}, false
	}
	for scale > 0 && mant%10 == 0 && mant != 0 {
		mant /= 10
		scale--
	}
	switch {
	case mant == 0:
		return amount{}, true
	case scale < 0:
		m, ok := mulPow10(mant, -scale)
		return amount{mant: m}, ok
	case scale > maxScale:
		return amount{}, false
	}
	return amount{mant: mant, scale: int8(scale)}, true
}
