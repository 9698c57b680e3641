package redistest

import (
	"context"
	"fmt"
	"net"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

const clusterSlots = 16384

// Cluster is a Redis Cluster of separate redis-server processes.
// Masters and Replicas reflect the roles at creation; after a failover
// the actual roles differ.
type Cluster struct {
	Masters  []*Server
	Replicas []*Server // Replicas[i*replicasPerMaster+j] replicates Masters[i]
	Addrs    []string  // every node's address, usable as seeds
}

// StartCluster creates a cluster of masters with replicasPerMaster replicas
// each, slots split evenly, and waits until every node reports
// cluster_state:ok, full slot coverage and the intended replica links.
// A short node timeout (1 s) keeps failover to a few seconds; failover
// needs a majority of masters alive, so use at least 3 masters for it.
func StartCluster(tb testing.TB, masters, replicasPerMaster int) *Cluster {
	tb.Helper()
	if masters < 1 || replicasPerMaster < 0 {
		tb.Fatalf("redistest: StartCluster(%d, %d): need at least one master", masters, replicasPerMaster)
	}
	n := masters * (1 + replicasPerMaster)
	specs := make([]spec, n)
	for i := range specs {
		specs[i] = spec{
			nports: 2, // client port and cluster bus port
			argsFn: func(dir string, ports []int) []string {
				return append(baseArgs(dir),
					"--port", strconv.Itoa(ports[0]),
					"--cluster-enabled", "yes",
					"--cluster-config-file", filepath.Join(dir, "nodes.conf"),
					"--cluster-node-timeout", "1000",
					// Explicit bus port: the default port+10000 may be taken or >65535.
					"--cluster-port", strconv.Itoa(ports[1]),
					// Always let a replica fail over, however stale its data.
					"--cluster-replica-validity-factor", "0",
				)
			},
		}
	}
	nodes := startServers(tb, specs)
	c := &Cluster{Masters: nodes[:masters], Replicas: nodes[masters:]}
	for _, s := range nodes {
		c.Addrs = append(c.Addrs, s.Addr)
	}
	if err := c.create(replicasPerMaster); err != nil {
		tb.Fatalf("redistest: creating cluster: %v%s", err, c.logTails())
	}
	c.WaitHealthy(tb, 15*time.Second)
	return c
}

func (c *Cluster) nodes() []*Server {
	return append(append([]*Server(nil), c.Masters...), c.Replicas...)
}

// create does what `redis-cli --cluster create` does, minus its fixed
// sleeps: distinct config epochs, slot assignment, MEET, REPLICATE.
func (c *Cluster) create(replicasPerMaster int) error {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	nodes := c.nodes()
	ids := make(map[*Server]string, len(nodes))
	for i, s := range nodes {
		id, err := s.adminClient().Do(ctx, "CLUSTER", "MYID").Text()
		if err != nil {
			return fmt.Errorf("%s CLUSTER MYID: %w", s.Addr, err)
		}
		ids[s] = id
		// Distinct epochs up front avoid the slow epoch-collision resolution.
		if err := s.adminClient().Do(ctx, "CLUSTER", "SET-CONFIG-EPOCH", i+1).Err(); err != nil {
			return fmt.Errorf("%s CLUSTER SET-CONFIG-EPOCH: %w", s.Addr, err)
		}
	}
	for i, m := range c.Masters {
		lo := i * clusterSlots / len(c.Masters)
		hi := (i+1)*clusterSlots/len(c.Masters) - 1
		if err := m.adminClient().Do(ctx, "CLUSTER", "ADDSLOTSRANGE", lo, hi).Err(); err != nil {
			return fmt.Errorf("%s CLUSTER ADDSLOTSRANGE %d %d: %w", m.Addr, lo, hi, err)
		}
	}
	first := nodes[0]
	for _, s := range nodes[1:] {
		if err := first.adminClient().Do(ctx, "CLUSTER", "MEET", "127.0.0.1", s.ports[0], s.ports[1]).Err(); err != nil {
			return fmt.Errorf("CLUSTER MEET %s: %w", s.Addr, err)
		}
	}
	// REPLICATE needs the replica to already know its master, so retry
	// until gossip has delivered it.
	for i, r := range c.Replicas {
		m := c.Masters[i/max(replicasPerMaster, 1)]
		reason := pollUntil(10*time.Second, func(ctx context.Context) string {
			if err := r.adminClient().Do(ctx, "CLUSTER", "REPLICATE", ids[m]).Err(); err != nil {
				return err.Error()
			}
			return ""
		})
		if reason != "" {
			return fmt.Errorf("%s CLUSTER REPLICATE %s: %s", r.Addr, m.Addr, reason)
		}
	}
	// Wait until every node sees every other node with its final role, so
	// masters will vote for the right replica when a test kills a master.
	reason := pollUntil(15*time.Second, func(ctx context.Context) string {
		for _, s := range nodes {
			out, err := s.adminClient().ClusterNodes(ctx).Result()
			if err != nil {
				return fmt.Sprintf("%s CLUSTER NODES: %v", s.Addr, err)
			}
			view := parseClusterNodes(out)
			if len(view) != len(nodes) {
				return fmt.Sprintf("%s knows %d of %d nodes", s.Addr, len(view), len(nodes))
			}
			for i, r := range c.Replicas {
				nr, ok := view[ids[r]]
				want := ids[c.Masters[i/max(replicasPerMaster, 1)]]
				if !ok || !nr.has("slave") || nr.master != want {
					return fmt.Sprintf("%s does not yet see %s as replica of %s", s.Addr, r.Addr, want)
				}
			}
			for id, nv := range view {
				if nv.has("handshake") || nv.has("noaddr") || nv.has("fail?") || nv.has("fail") {
					return fmt.Sprintf("%s sees node %s as %s", s.Addr, id, nv.flags)
				}
			}
		}
		for _, r := range c.Replicas {
			info, err := r.adminClient().Info(ctx, "replication").Result()
			if err != nil {
				return fmt.Sprintf("%s INFO: %v", r.Addr, err)
			}
			if infoField(info, "master_link_status") != "up" {
				return fmt.Sprintf("%s replication link not up yet", r.Addr)
			}
		}
		return ""
	})
	if reason != "" {
		return fmt.Errorf("cluster did not converge: %s", reason)
	}
	return nil
}

type clusterNode struct {
	addr, flags, master string
}

func (n clusterNode) has(flag string) bool {
	for _, f := range strings.Split(n.flags, ",") {
		if f == flag {
			return true
		}
	}
	return false
}

// parseClusterNodes maps node ID to its CLUSTER NODES line fields.
func parseClusterNodes(out string) map[string]clusterNode {
	view := make(map[string]clusterNode)
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		f := strings.Fields(line)
		if len(f) < 8 {
			continue
		}
		addr, _, _ := strings.Cut(f[1], "@")
		view[f[0]] = clusterNode{addr: addr, flags: f[2], master: f[3]}
	}
	return view
}

// Client returns a go-redis ClusterClient seeded with every node address,
// closed in Cleanup. Note that go-redis refreshes its slot map only on
// MOVED/ASK or every ClusterStateReloadInterval (60 s default), so after
// killing a master call ReloadState or expect "connection refused".
func (c *Cluster) Client(tb testing.TB) *redis.ClusterClient {
	tb.Helper()
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: append([]string(nil), c.Addrs...)})
	tb.Cleanup(func() { cc.Close() })
	return cc
}

// WaitHealthy waits until every running node reports cluster_state:ok with
// all 16384 slots ok, and every slot is served by a running node in that
// node's view. The last check matters right after a kill: nodes keep
// saying "ok" until they have flagged the dead master as failed.
func (c *Cluster) WaitHealthy(tb testing.TB, timeout time.Duration) {
	tb.Helper()
	if reason := pollUntil(timeout, c.unhealthy); reason != "" {
		tb.Fatalf("redistest: cluster not healthy after %v: %s%s", timeout, reason, c.logTails())
	}
}

func (c *Cluster) unhealthy(ctx context.Context) string {
	live := make(map[string]bool)
	var nodes []*Server
	for _, s := range c.nodes() {
		if s.Running() {
			live[s.Addr] = true
			nodes = append(nodes, s)
		}
	}
	if len(nodes) == 0 {
		return "no running nodes"
	}
	for _, s := range nodes {
		info, err := s.adminClient().ClusterInfo(ctx).Result()
		if err != nil {
			return fmt.Sprintf("%s CLUSTER INFO: %v", s.Addr, err)
		}
		if st := infoField(info, "cluster_state"); st != "ok" {
			return fmt.Sprintf("%s cluster_state:%s", s.Addr, st)
		}
		if ok := infoField(info, "cluster_slots_ok"); ok != strconv.Itoa(clusterSlots) {
			return fmt.Sprintf("%s cluster_slots_ok:%s", s.Addr, ok)
		}
		slots, err := s.adminClient().ClusterSlots(ctx).Result()
		if err != nil {
			return fmt.Sprintf("%s CLUSTER SLOTS: %v", s.Addr, err)
		}
		covered := 0
		for _, r := range slots {
			if len(r.Nodes) == 0 {
				return fmt.Sprintf("%s: slots %d-%d have no node", s.Addr, r.Start, r.End)
			}
			if m := r.Nodes[0].Addr; !live[m] {
				return fmt.Sprintf("%s: slots %d-%d still served by %s, which is not running", s.Addr, r.Start, r.End, m)
			}
			covered += int(r.End - r.Start + 1)
		}
		if covered != clusterSlots {
			return fmt.Sprintf("%s: CLUSTER SLOTS covers %d slots", s.Addr, covered)
		}
	}
	return ""
}

// logTails formats the last log lines of every node for failure messages.
func (c *Cluster) logTails() string {
	var b strings.Builder
	for _, s := range c.nodes() {
		fmt.Fprintf(&b, "\n--- %s (%s) log tail ---\n%s", s.Addr, s.Dir, s.LogTail(10))
	}
	return b.String()
}

// hostPort is shared by the sentinel helpers.
func hostPort(host string, port int) string { return net.JoinHostPort(host, strconv.Itoa(port)) }
