package redisbatch

import "strings"

// Slots is the number of Redis Cluster hash slots.
const Slots = 16384

// HashTag is the part of key that Redis Cluster hashes when it has a
// hash tag: between the first '{' and the first '}' after it, if not
// empty.
func HashTag(key string) (string, bool) {
	if s := strings.IndexByte(key, '{'); s >= 0 {
		if e := strings.IndexByte(key[s+1:], '}'); e > 0 {
			return key[s+1 : s+1+e], true
		}
	}
	return key, false
}

// Slot is the Redis Cluster hash slot of key.
func Slot(key string) int {
	tag, _ := HashTag(key)
	return int(CRC16(tag) % Slots)
}

// CRC16 is the CRC-16/XMODEM of s, as Redis Cluster computes it.
func CRC16(s string) uint16 {
	var crc uint16
	for i := 0; i < len(s); i++ {
		crc ^= uint16(s[i]) << 8
		for range 8 {
			if crc&0x8000 != 0 {
				crc = crc<<1 ^ 0x1021
			} else {
				crc <<= 1
			}
		}
	}
	return crc
}
