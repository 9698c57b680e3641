package redisbatch

import "testing"

// TestSlotIsRedisClusters: Slot computes the hash slot Redis Cluster
// gives a key (CLUSTER KEYSLOT; the examples of the Cluster
// specification), by which calls are grouped and lease records placed.
func TestSlotIsRedisClusters(t *testing.T) {
	for key, want := range map[string]int{
		"123456789":            0x31C3 % Slots, // CRC16/XMODEM's check value, 12739
		"somekey":              11058,
		"foo":                  12182,
		"foo{hash_tag}":        2515,
		"bar{hash_tag}":        2515,
		"{}key":                int(CRC16("{}key") % Slots), // an empty tag is no tag: the whole key
		"foo{}{bar}":           int(CRC16("foo{}{bar}") % Slots),
		"a{b}c{d}":             Slot("b"),
		"{user1000}.x":         Slot("user1000"),
		"{user1000}.following": Slot("user1000"),
		"prefix{z|t|k}|gn":     Slot("z|t|k"),
	} {
		if got := Slot(key); got != want {
			t.Errorf("Slot(%q) = %d, want %d", key, got, want)
		}
	}
	if got := CRC16("123456789"); got != 0x31C3 {
		t.Errorf("CRC16: %#x, want 0x31c3", got)
	}
}
