package redistest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/testproc"
	"github.com/redis/go-redis/v9"
)

// Sentinel is one master, one replica and three sentinels monitoring them
// with quorum 2. Master and Replica reflect the roles at creation.
type Sentinel struct {
	Master, Replica *Server
	Sentinels       []*Server
	MasterName      string
	SentinelAddrs   []string
}

const sentinelCount = 3

// StartSentinel starts the master, a replica in sync with it, and three
// sentinels (down-after 1 s, failover-timeout 5 s), and waits until every
// sentinel knows the master, the replica and the other sentinels.
func StartSentinel(tb testing.TB) *Sentinel {
	tb.Helper()
	st := &Sentinel{MasterName: "redistest"}
	st.Master = Start(tb)
	st.Replica = Start(tb, "--replicaof", "127.0.0.1", strconv.Itoa(st.Master.Port))
	if reason := pollUntil(10*time.Second, func(ctx context.Context) string {
		return replicaLinkDown(ctx, st.Replica)
	}); reason != "" {
		tb.Fatalf("redistest: replica never synced: %s\n--- replica log ---\n%s\n--- master log ---\n%s",
			reason, st.Replica.LogTail(20), st.Master.LogTail(20))
	}

	// Pre-seed each sentinel with the others' IDs and ports; otherwise they
	// only discover each other via hello messages sent every 2 s.
	ports, err := testproc.FreePorts(sentinelCount)
	if err != nil {
		tb.Fatalf("redistest: %v", err)
	}
	ids := make([]string, sentinelCount)
	for i := range ids {
		ids[i] = randomID()
	}
	specs := make([]spec, sentinelCount)
	for i := range specs {
		dir := tb.TempDir()
		var conf strings.Builder
		fmt.Fprintf(&conf, "sentinel myid %s\n", ids[i])
		// resolve-hostnames must precede monitor.
		fmt.Fprintf(&conf, "sentinel resolve-hostnames no\n")
		fmt.Fprintf(&conf, "sentinel monitor %s 127.0.0.1 %d 2\n", st.MasterName, st.Master.Port)
		fmt.Fprintf(&conf, "sentinel down-after-milliseconds %s 1000\n", st.MasterName)
		fmt.Fprintf(&conf, "sentinel failover-timeout %s 5000\n", st.MasterName)
		fmt.Fprintf(&conf, "sentinel known-replica %s 127.0.0.1 %d\n", st.MasterName, st.Replica.Port)
		for j := range ids {
			if j != i {
				fmt.Fprintf(&conf, "sentinel known-sentinel %s 127.0.0.1 %d %s\n", st.MasterName, ports[j], ids[j])
			}
		}
		confPath := filepath.Join(dir, "sentinel.conf")
		// Sentinel rewrites its config at runtime, so it must be writable.
		if err := os.WriteFile(confPath, []byte(conf.String()), 0o644); err != nil {
			tb.Fatalf("redistest: %v", err)
		}
		specs[i] = spec{
			nports: 1,
			ports:  ports[i : i+1],
			dir:    dir,
			argsFn: func(dir string, ports []int) []string {
				return []string{confPath, "--sentinel",
					"--bind", "127.0.0.1",
					"--port", strconv.Itoa(ports[0]),
					"--daemonize", "no",
					"--dir", dir,
					"--logfile", filepath.Join(dir, "redis.log"),
				}
			},
		}
	}
	st.Sentinels = startServers(tb, specs)
	for _, s := range st.Sentinels {
		st.SentinelAddrs = append(st.SentinelAddrs, s.Addr)
	}
	if reason := pollUntil(15*time.Second, st.notReady); reason != "" {
		tb.Fatalf("redistest: sentinels not ready: %s%s", reason, st.logTails())
	}
	return st
}

func randomID() string {
	b := make([]byte, 20)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func replicaLinkDown(ctx context.Context, r *Server) string {
	info, err := r.adminClient().Info(ctx, "replication").Result()
	if err != nil {
		return fmt.Sprintf("%s INFO: %v", r.Addr, err)
	}
	if infoField(info, "role") != "slave" || infoField(info, "master_link_status") != "up" {
		return fmt.Sprintf("%s: role:%s master_link_status:%s", r.Addr,
			infoField(info, "role"), infoField(info, "master_link_status"))
	}
	return ""
}

// withSentinel runs fn with a short-lived sentinel client; polling opens a
// fresh connection each time, which is cheap on loopback.
func withSentinel[T any](s *Server, fn func(sc *redis.SentinelClient) T) T {
	sc := redis.NewSentinelClient(s.adminOptions())
	defer sc.Close()
	return fn(sc)
}

func (st *Sentinel) notReady(ctx context.Context) string {
	for _, s := range st.Sentinels {
		if reason := withSentinel(s, func(sc *redis.SentinelClient) string {
			m, err := sc.Master(ctx, st.MasterName).Result()
			if err != nil {
				return fmt.Sprintf("%s SENTINEL MASTER: %v", s.Addr, err)
			}
			if m["flags"] != "master" || m["num-slaves"] != "1" ||
				m["num-other-sentinels"] != strconv.Itoa(sentinelCount-1) {
				return fmt.Sprintf("%s: master flags=%s num-slaves=%s num-other-sentinels=%s",
					s.Addr, m["flags"], m["num-slaves"], m["num-other-sentinels"])
			}
			reps, err := sc.Replicas(ctx, st.MasterName).Result()
			if err != nil {
				return fmt.Sprintf("%s SENTINEL REPLICAS: %v", s.Addr, err)
			}
			if len(reps) != 1 || reps[0]["flags"] != "slave" || reps[0]["master-link-status"] != "ok" {
				return fmt.Sprintf("%s: replicas %v", s.Addr, reps)
			}
			return ""
		}); reason != "" {
			return reason
		}
	}
	return ""
}

// CurrentMaster returns the master address ("127.0.0.1:port") according to
// the first running sentinel that answers.
func (st *Sentinel) CurrentMaster(tb testing.TB) string {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var errs []string
	for _, s := range st.Sentinels {
		if !s.Running() {
			continue
		}
		addr, err := st.masterAddr(ctx, s)
		if err == nil {
			return addr
		}
		errs = append(errs, err.Error())
	}
	tb.Fatalf("redistest: no sentinel answered get-master-addr-by-name: %s", strings.Join(errs, "; "))
	return ""
}

func (st *Sentinel) masterAddr(ctx context.Context, s *Server) (string, error) {
	sc := redis.NewSentinelClient(s.adminOptions())
	defer sc.Close()
	hp, err := sc.GetMasterAddrByName(ctx, st.MasterName).Result()
	if err != nil {
		return "", fmt.Errorf("%s: %w", s.Addr, err)
	}
	if len(hp) != 2 {
		return "", fmt.Errorf("%s: unexpected reply %v", s.Addr, hp)
	}
	port, _ := strconv.Atoi(hp[1])
	return hostPort(hp[0], port), nil
}

// WaitFailover waits until every running sentinel reports a master other
// than oldMaster and that server itself reports role:master, then returns
// its address. Waiting for all sentinels to agree means any sentinel-based
// client created afterwards sees the new master.
func (st *Sentinel) WaitFailover(tb testing.TB, oldMaster string, timeout time.Duration) string {
	tb.Helper()
	var newMaster string
	reason := pollUntil(timeout, func(ctx context.Context) string {
		newMaster = ""
		for _, s := range st.Sentinels {
			if !s.Running() {
				continue
			}
			addr, err := st.masterAddr(ctx, s)
			if err != nil {
				return err.Error()
			}
			if addr == oldMaster {
				return fmt.Sprintf("%s still reports %s", s.Addr, addr)
			}
			if newMaster != "" && addr != newMaster {
				return fmt.Sprintf("sentinels disagree: %s vs %s", newMaster, addr)
			}
			newMaster = addr
		}
		if newMaster == "" {
			return "no running sentinels"
		}
		c := redis.NewClient(&redis.Options{Addr: newMaster, Protocol: 2, MaxRetries: -1,
			DialTimeout: 500 * time.Millisecond, ReadTimeout: time.Second})
		defer c.Close()
		info, err := c.Info(ctx, "replication").Result()
		if err != nil {
			return fmt.Sprintf("new master %s INFO: %v", newMaster, err)
		}
		if role := infoField(info, "role"); role != "master" {
			return fmt.Sprintf("new master %s has role:%s", newMaster, role)
		}
		return ""
	})
	if reason != "" {
		tb.Fatalf("redistest: no failover away from %s within %v: %s%s", oldMaster, timeout, reason, st.logTails())
	}
	return newMaster
}

// FailoverClient returns a sentinel-backed go-redis client that follows the
// current master, closed in Cleanup.
func (st *Sentinel) FailoverClient(tb testing.TB) *redis.Client {
	tb.Helper()
	c := redis.NewFailoverClient(&redis.FailoverOptions{
		MasterName:    st.MasterName,
		SentinelAddrs: append([]string(nil), st.SentinelAddrs...),
	})
	tb.Cleanup(func() { c.Close() })
	return c
}

func (st *Sentinel) logTails() string {
	var b strings.Builder
	for _, s := range append([]*Server{st.Master, st.Replica}, st.Sentinels...) {
		fmt.Fprintf(&b, "\n--- %s (%s) log tail ---\n%s", s.Addr, s.Dir, s.LogTail(10))
	}
	return b.String()
}
