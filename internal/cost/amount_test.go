package cost

import (
	"errors"
	"math"
	"math/big"
	"math/rand/v2"
	"strconv"
	"testing"
)

// TestAmountsAreExactDecimalsAndFallBackToFloatsPastTheirDigits: the
// arithmetic of weighted sums: decimals read exactly, products and sums
// exact while their digits fit 64 bits, floats past that (and 0 times
// anything 0), rounded up to whole tokens within 2^53.
func TestAmountsAreExactDecimalsAndFallBackToFloatsPastTheirDigits(t *testing.T) {
	read := func(text string) amount {
		a, err := parseAmount(text)
		if err != nil {
			t.Fatalf("%s: %v", text, err)
		}
		return a
	}
	for _, tc := range []struct {
		text  string
		mant  int64
		scale int8
	}{
		{"0.07", 7, 2}, {"100", 100, 0}, {"1.50", 15, 1}, {".5", 5, 1}, {"+2", 2, 0}, {"2.5e3", 2500, 0},
		{"25E-3", 25, 3}, {"0", 0, 0}, {"0.000", 0, 0}, {"1e18", 1e18, 0}, {" 4 ", 4, 0},
		{"123456789.123456789", 123456789123456789, 9}, {"1e-18", 1, 18},
	} {
		if a := read(tc.text); a.inexact || a.mant != tc.mant || a.scale != tc.scale {
			t.Errorf("%q: %+v, want exactly %d / 10^%d", tc.text, a, tc.mant, tc.scale)
		}
	}
	for _, text := range []string{"1e19", "1e-19", "12345678901234567890", "0x1p-2", "1e308"} {
		if a := read(text); !a.inexact {
			t.Errorf("%q: %+v, want a float", text, a)
		}
	}
	for _, tc := range []struct {
		text, why string
	}{{"-1", "is negative"}, {"abc", "is not a number"}, {"1e999", "is infinite"}, {"NaN", "is not a number"}, {"", "is not a number"}, {"1..2", "is not a number"}} {
		if _, err := parseAmount(tc.text); err == nil || err.Error() != tc.why {
			t.Errorf("%q: %v, want %q", tc.text, err, tc.why)
		}
	}

	for _, tc := range []struct {
		name string
		got  amount
		want int64
	}{
		{"0.07 × 100", read("0.07").mul(read("100")), 7},
		{"0.14 × 100 + 0.07 × 100", read("0.14").mul(read("100")).add(read("0.07").mul(read("100"))), 21},
		{"4096 × 5 × 0.07", read("4096").mul(read("5")).mul(read("0.07")), 1434},
		{"0.1 + 0.2 + 0.7", read("0.1").add(read("0.2")).add(read("0.7")), 1},
		{"1e-18 × 1e-18, past the digits: a float, above 0", read("1e-18").mul(read("1e-18")), 1},
		{"9e18 × 2, past 64 bits", read("9e18").mul(read("2")), MaxTokens},
		{"1e308 × 10 × 0", read("1e308").mul(read("10")).mul(read("0")), 0},
		{"0 × 1e308", read("0").mul(read("1e308")), 0},
		{"1e18 + 0.5, past the digits", read("1e18").add(read("0.5")), MaxTokens},
		{"a float's 0.1 read back", amountOfFloat(0.1).mul(read("70")), 7},
		{"a float's 1.15", amountOfFloat(1.15).mul(read("20")), 23},
		{"a float's 350", amountOfFloat(350), 350},
		{"a float's 2^60", amountOfFloat(math.Ldexp(1, 60)), MaxTokens},
	} {
		if got := tc.got.ceil(); got != tc.want {
			t.Errorf("%s: %+v rounds up to %d, want %d", tc.name, tc.got, got, tc.want)
		}
	}
}

// FuzzDecimalReadsWhatParseFloatReads: a number that decimalOf reads
// exactly is the number strconv.ParseFloat reads (to its precision), and
// its arithmetic never loses a product that is exact.
func FuzzDecimalReadsWhatParseFloatReads(f *testing.F) {
	for _, s := range []string{"0.07", "100", "1e-18", "2.5E3", ".5", "+1", "123456789.123456789", "1e19", "-1", "0x10", "1_0", "5.", "e5", "1e", "00012.3400"} {
		f.Add(s, "3")
	}
	f.Fuzz(func(t *testing.T, a, b string) {
		x, ok := decimalOf(a)
		v, err := strconv.ParseFloat(a, 64)
		if !ok {
			return
		}
		if err != nil && !errors.Is(err, strconv.ErrRange) {
			t.Fatalf("%q: decimalOf reads %+v, ParseFloat refuses it: %v", a, x, err)
		}
		if got := x.float(); math.Abs(got-v) > 1e-15*math.Abs(v) {
			t.Fatalf("%q: decimalOf reads %v, ParseFloat %v", a, got, v)
		}
		y, ok := decimalOf(b)
		if !ok {
			return
		}
		p, s := x.mul(y), x.add(y)
		if w := x.float() * y.float(); math.Abs(p.float()-w) > 1e-12*math.Abs(w) {
			t.Fatalf("%q × %q: %v, want about %v", a, b, p.float(), w)
		}
		if w := x.float() + y.float(); math.Abs(s.float()-w) > 1e-12*math.Abs(w) {
			t.Fatalf("%q + %q: %v, want about %v", a, b, s.float(), w)
		}
		if c := p.ceil(); float64(c) < math.Min(p.float(), MaxTokens)-1e-6 {
			t.Fatalf("%q × %q: %v rounds up to %d", a, b, p.float(), c)
		}
	})
}

// TestAmountArithmeticMatchesExactRationals: products and sums of
// decimals of up to 7 digits, 4 after the point, round up to what exact
// rational arithmetic does (a seeded sample of 20,000).
func TestAmountArithmeticMatchesExactRationals(t *testing.T) {
	rng := rand.New(rand.NewPCG(38, 5))
	decimal := func() string {
		return strconv.FormatFloat(float64(rng.IntN(10_000_000))/math.Pow10(rng.IntN(5)), 'f', -1, 64)
	}
	ceil := func(r *big.Rat) int64 {
		q, m := new(big.Int).DivMod(r.Num(), r.Denom(), new(big.Int))
		if m.Sign() != 0 {
			q.Add(q, big.NewInt(1))
		}
		return q.Int64()
	}
	for range 20_000 {
		a, b, c := decimal(), decimal(), decimal()
		x, _ := decimalOf(a)
		y, _ := decimalOf(b)
		z, _ := decimalOf(c)
		ra, _ := new(big.Rat).SetString(a)
		rb, _ := new(big.Rat).SetString(b)
		rc, _ := new(big.Rat).SetString(c)
		want := new(big.Rat).Add(new(big.Rat).Mul(ra, rb), rc)
		if got := x.mul(y).add(z).ceil(); got != ceil(want) {
			t.Fatalf("%s × %s + %s: %d, want %d (%s)", a, b, c, got, ceil(want), want.FloatString(10))
		}
	}
}
