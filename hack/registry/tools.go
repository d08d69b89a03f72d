//go:build tools

// Package tools records the commands this module builds so `go mod tidy` keeps them.
package tools

import (
	_ "github.com/distribution/distribution/v3/cmd/registry"
	_ "github.com/google/go-containerregistry/cmd/crane"
)
