package redistest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/testproc"
)

// TLSServer is a redis-server that only listens for TLS (plain port 0).
// The embedded Server's Addr/Port are the TLS endpoint and its Client and
// Options already trust CAFile and present the client certificate.
type TLSServer struct {
	*Server
	// CAFile signed CertFile and ClientCertFile.
	CAFile string
	// CertFile and KeyFile are the server's pair (SANs 127.0.0.1, ::1, localhost).
	CertFile, KeyFile string
	// ClientCertFile and ClientKeyFile are a client pair signed by CAFile.
	ClientCertFile, ClientKeyFile string
	// OtherCAFile is an unrelated CA, for "wrong CA" tests.
	OtherCAFile string
}

// StartTLS starts a TLS-only redis-server with freshly generated
// certificates. With requireClientCert, redis rejects clients that do not
// present a certificate signed by CAFile (--tls-auth-clients yes).
func StartTLS(tb testing.TB, requireClientCert bool) *TLSServer {
	tb.Helper()
	testproc.SkipShort(tb, "redis-server") // before making certificates for it
	dir := tb.TempDir()
	ts := &TLSServer{
		CAFile:         filepath.Join(dir, "ca.crt"),
		CertFile:       filepath.Join(dir, "server.crt"),
		KeyFile:        filepath.Join(dir, "server.key"),
		ClientCertFile: filepath.Join(dir, "client.crt"),
		ClientKeyFile:  filepath.Join(dir, "client.key"),
		OtherCAFile:    filepath.Join(dir, "other-ca.crt"),
	}
	if err := ts.writeCerts(); err != nil {
		tb.Fatalf("redistest: generating TLS certificates: %v", err)
	}
	cfg, err := ts.clientConfig()
	if err != nil {
		tb.Fatalf("redistest: %v", err)
	}
	authClients := "no"
	if requireClientCert {
		authClients = "yes"
	}
	sp := spec{
		nports:    1,
		tlsConfig: cfg,
		dir:       dir,
		argsFn: func(dir string, ports []int) []string {
			return append(baseArgs(dir),
				"--port", "0",
				"--tls-port", strconv.Itoa(ports[0]),
				"--tls-cert-file", ts.CertFile,
				"--tls-key-file", ts.KeyFile,
				"--tls-ca-cert-file", ts.CAFile,
				"--tls-auth-clients", authClients,
			)
		},
	}
	ts.Server = startServers(tb, []spec{sp})[0]
	return ts
}

// Rotate replaces every certificate and key, the CA's included, in the
// same files and restarts the server on them, as an operator rotating
// certificates does. Clients that trust only the old CA fail from then on.
func (s *TLSServer) Rotate(tb testing.TB) {
	tb.Helper()
	s.Stop(tb)
	if err := s.writeCerts(); err != nil {
		tb.Fatalf("redistest: generating new TLS certificates: %v", err)
	}
	cfg, err := s.clientConfig()
	if err != nil {
		tb.Fatalf("redistest: %v", err)
	}
	s.mu.Lock()
	s.tlsConfig = cfg
	admin := s.admin
	s.admin = nil
	s.mu.Unlock()
	if admin != nil {
		admin.Close()
	}
	s.Restart(tb)
}

// TLSConfig returns a fresh client config that trusts CAFile and presents
// the client certificate; tests may modify it freely.
func (s *TLSServer) TLSConfig() *tls.Config { return s.tlsConfig.Clone() }

func (s *TLSServer) clientConfig() (*tls.Config, error) {
	caPEM, err := os.ReadFile(s.CAFile)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(caPEM)
	pair, err := tls.LoadX509KeyPair(s.ClientCertFile, s.ClientKeyFile)
	if err != nil {
		return nil, err
	}
	return &tls.Config{
		RootCAs:      pool,
		Certificates: []tls.Certificate{pair},
		ServerName:   "127.0.0.1",
		MinVersion:   tls.VersionTLS12,
	}, nil
}

func (s *TLSServer) writeCerts() error {
	ca, caKey, err := newCert("redistest CA", nil, nil, true, nil)
	if err != nil {
		return err
	}
	other, otherKey, err := newCert("redistest other CA", nil, nil, true, nil)
	if err != nil {
		return err
	}
	srv, srvKey, err := newCert("redistest server", ca, caKey, false,
		[]x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth})
	if err != nil {
		return err
	}
	cli, cliKey, err := newCert("redistest client", ca, caKey, false,
		[]x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth})
	if err != nil {
		return err
	}
	for path, der := range map[string][]byte{
		s.CAFile:         ca.Raw,
		s.OtherCAFile:    other.Raw,
		s.CertFile:       srv.Raw,
		s.ClientCertFile: cli.Raw,
	} {
		if err := writePEM(path, "CERTIFICATE", der); err != nil {
			return err
		}
	}
	for path, key := range map[string]*ecdsa.PrivateKey{
		s.KeyFile:       srvKey,
		s.ClientKeyFile: cliKey,
		strings.TrimSuffix(s.OtherCAFile, ".crt") + ".key": otherKey,
	} {
		der, err := x509.MarshalPKCS8PrivateKey(key)
		if err != nil {
			return err
		}
		if err := writePEM(path, "PRIVATE KEY", der); err != nil {
			return err
		}
	}
	return nil
}

func writePEM(path, typ string, der []byte) error {
	return os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600)
}

// newCert creates a CA (isCA, self-signed when parent is nil) or a leaf
// signed by parent. ECDSA P-256 keeps generation fast.
func newCert(cn string, parent *x509.Certificate, parentKey *ecdsa.PrivateKey, isCA bool,
	usage []x509.ExtKeyUsage) (*x509.Certificate, *ecdsa.PrivateKey, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	if err != nil {
		return nil, nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: cn, Organization: []string{"redistest"}},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		ExtKeyUsage:  usage,
	}
	if isCA {
		tmpl.IsCA = true
		tmpl.BasicConstraintsValid = true
		tmpl.KeyUsage = x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature
	} else {
		tmpl.KeyUsage = x509.KeyUsageDigitalSignature
		tmpl.IPAddresses = []net.IP{net.ParseIP("127.0.0.1"), net.IPv6loopback}
		tmpl.DNSNames = []string{"localhost"}
	}
	signer, signerKey := tmpl, key
	if parent != nil {
		signer, signerKey = parent, parentKey
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, signer, &key.PublicKey, signerKey)
	if err != nil {
		return nil, nil, err
	}
	cert, err := x509.ParseCertificate(der)
	return cert, key, err
}
