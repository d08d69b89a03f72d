//go:build tools

// Package tools records the command this module builds so `go mod tidy` keeps it.
package tools

import (
	_ "github.com/seaweedfs/seaweedfs/weed"
)
