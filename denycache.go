package ratelimit

// The deny cache as the Redis store's reports reach it: nil when the
// handler has no deny layer (store memory, several Cluster groups).

// forgetDenials drops the cached denials of buckets the admin API reset,
// one at a time: requests do not wait for the whole list.
func (h *Handler) forgetDenials(keys []string) {
	if h.denied == nil {
		return
	}
	for _, key := range keys {
		h.denied.Forget(key)
	}
}

// forgetAllDenials drops every cached denial: resets may have been missed.
func (h *Handler) forgetAllDenials() {
	if h.denied != nil {
		h.denied.ForgetAll()
	}
}

// forgetRefilled drops the cached denials of the buckets at keys, to
// which a settlement gave tokens back: they came back sooner than time
// alone would bring them, and a cached denial would refuse what now fits.
func (h *Handler) forgetRefilled(keys []string) {
	if h.denied != nil {
		h.denied.Forget(keys...)
	}
}
