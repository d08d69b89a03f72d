// Command regfront is the test registry's front door: a reverse proxy on loopback that
// asks for HTTP Basic credentials (checked against an htpasswd file of bcrypt hashes)
// on the protected repository prefixes only, and passes every other request to the
// distribution registry behind it anonymously.
//
// distribution's own htpasswd auth is all-or-nothing (every repository, including
// /v2/ itself), and its per-repository alternative is token auth, which needs a token
// server issuing signed JWTs. A front this small gives the one thing the tests need,
// a registry where `private/*` needs a pull secret while the rest is public, which is
// how e.g. Harbor or Artifactory serve public and private projects with Basic auth.
//
//	regfront serve --listen 127.0.0.1:15000 --backend http://127.0.0.1:15001 \
//	    --htpasswd FILE --protect private
//	regfront hash USER PASSWORD   # prints an htpasswd line (bcrypt)
package main

import (
	"crypto/sha256"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"path"
	"strings"
	"sync"

	"golang.org/x/crypto/bcrypt"
)

const realm = "ramify-test-registry"

func main() {
	if len(os.Args) < 2 {
		usage()
	}
	switch os.Args[1] {
	case "hash":
		if len(os.Args) != 4 {
			usage()
		}
		h, err := bcrypt.GenerateFromPassword([]byte(os.Args[3]), bcrypt.DefaultCost)
		if err != nil {
			log.Fatalf("regfront: bcrypt: %v", err)
		}
		fmt.Printf("%s:%s\n", os.Args[2], h)
	case "serve":
		serve(os.Args[2:])
	default:
		usage()
	}
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: regfront serve --listen ADDR --backend URL --htpasswd FILE --protect PREFIX[,PREFIX]\n       regfront hash USER PASSWORD")
	os.Exit(2)
}

type front struct {
	users   map[string][]byte // user -> bcrypt hash
	protect []string          // repository prefixes, e.g. "private"
	proxy   *httputil.ReverseProxy
	// bcrypt costs ~50 ms per check and a pull makes a request per blob: remember the
	// credentials already verified (by digest, never the password itself).
	mu       sync.Mutex
	verified map[[32]byte]bool
}

func serve(args []string) {
	fs := flag.NewFlagSet("serve", flag.ExitOnError)
	listen := fs.String("listen", "127.0.0.1:15000", "address to listen on")
	backend := fs.String("backend", "http://127.0.0.1:15001", "the registry behind the front")
	htpasswd := fs.String("htpasswd", "", "htpasswd file (bcrypt entries)")
	protect := fs.String("protect", "private", "comma-separated repository prefixes that need credentials")
	if err := fs.Parse(args); err != nil {
		log.Fatal(err)
	}
	target, err := url.Parse(*backend)
	if err != nil {
		log.Fatalf("regfront: --backend: %v", err)
	}
	users, err := readHtpasswd(*htpasswd)
	if err != nil {
		log.Fatalf("regfront: %v", err)
	}
	f := &front{users: users, proxy: httputil.NewSingleHostReverseProxy(target), verified: map[[32]byte]bool{}}
	for _, p := range strings.Split(*protect, ",") {
		if p = strings.Trim(p, "/ "); p != "" {
			f.protect = append(f.protect, p)
		}
	}
	log.Printf("regfront: listening on %s, backend %s, protected: %v, %d user(s)", *listen, target, f.protect, len(users))
	log.Fatal(http.ListenAndServe(*listen, f))
}

func readHtpasswd(file string) (map[string][]byte, error) {
	if file == "" {
		return nil, errors.New("--htpasswd is required")
	}
	data, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	users := map[string][]byte{}
	for _, line := range strings.Split(string(data), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		user, hash, ok := strings.Cut(line, ":")
		if !ok || !strings.HasPrefix(hash, "$2") {
			return nil, fmt.Errorf("%s: not a bcrypt htpasswd line: %q", file, user)
		}
		users[user] = []byte(hash)
	}
	return users, nil
}

func (f *front) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	p := r.URL.Path
	// The path decides whether credentials are needed, so it must mean exactly what
	// the registry will read: no escaped characters, no dot segments.
	if r.URL.RawPath != "" || path.Clean(p) != strings.TrimSuffix(p, "/") {
		log.Printf("regfront: 400 %s %s: non-canonical path", r.Method, r.URL.EscapedPath())
		writeError(w, http.StatusBadRequest, "NAME_INVALID", "non-canonical request path")
		return
	}
	authed, presented := f.check(r)
	if presented && !authed {
		// Wrong credentials are refused everywhere, as real registries do.
		log.Printf("regfront: 401 %s %s: invalid credentials", r.Method, p)
		f.challenge(w, "invalid username or password")
		return
	}
	if !authed && f.needsAuth(p) {
		// The base endpoint's challenge is routine; refusals of content are worth a line.
		if p != "/v2/" && p != "/v2" {
			log.Printf("regfront: 401 %s %s: no credentials", r.Method, p)
		}
		f.challenge(w, "authentication required")
		return
	}
	r.Header.Del("Authorization")
	f.proxy.ServeHTTP(w, r)
}

// needsAuth: the protected repositories, the catalog (it lists them), and the base
// endpoint /v2/, which answers 401 with the Basic challenge to anonymous callers as
// Docker Hub does, so clients learn the scheme before they pull: oci-client, for one,
// sends Basic credentials only after /v2/ challenged it. Anonymous pulls of public
// repositories still work: their paths need no credentials.
func (f *front) needsAuth(p string) bool {
	if p == "/v2" || p == "/v2/" || strings.HasPrefix(p, "/v2/_catalog") {
		return true
	}
	for _, prefix := range f.protect {
		if strings.HasPrefix(p, "/v2/"+prefix+"/") {
			return true
		}
	}
	return false
}

// check returns (credentials valid, credentials presented).
func (f *front) check(r *http.Request) (bool, bool) {
	if r.Header.Get("Authorization") == "" {
		return false, false
	}
	user, pass, ok := r.BasicAuth()
	if !ok {
		return false, true
	}
	hash, known := f.users[user]
	if !known {
		return false, true
	}
	key := sha256.Sum256([]byte(user + "\x00" + pass))
	f.mu.Lock()
	seen := f.verified[key]
	f.mu.Unlock()
	if seen {
		return true, true
	}
	if bcrypt.CompareHashAndPassword(hash, []byte(pass)) != nil {
		return false, true
	}
	f.mu.Lock()
	f.verified[key] = true
	f.mu.Unlock()
	return true, true
}

func (f *front) challenge(w http.ResponseWriter, msg string) {
	w.Header().Set("WWW-Authenticate", fmt.Sprintf("Basic realm=%q", realm))
	writeError(w, http.StatusUnauthorized, "UNAUTHORIZED", msg)
}

// writeError answers in the distribution spec's error format.
func writeError(w http.ResponseWriter, status int, code, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Docker-Distribution-API-Version", "registry/2.0")
	w.WriteHeader(status)
	body := map[string][]map[string]string{"errors": {{"code": code, "message": msg}}}
	if err := json.NewEncoder(w).Encode(body); err != nil {
		log.Printf("regfront: writing error response: %v", err)
	}
}
