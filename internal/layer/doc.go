// package layer holds the layers that wrap any store of buckets and
// answer its calls: the deny cache's, which refuses again, without
// asking the store, what the store refused, and the fallback's, which
// decides what the store below could not (the handler's on_error).
package layer
