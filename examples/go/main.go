// A redbatch client in Go (protocol v1, docs/protocol.md): XADD each request onto the
// model's stream with a msgpack payload, then BLPOP each request's reply key.
//
//	go run . "first text" "second text"
//	env: REDIS_URL (redis://127.0.0.1:6379/0), MODEL (minilm), TIMEOUT_S (30)
//
// Prints one reply envelope per line as JSON; exits 1 if any request failed or timed out.
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/vmihailenco/msgpack/v5"
)

const namespace = "redbatch"

// Envelope is a reply: a result when OK, an error otherwise.
type Envelope struct {
	ID     string         `msgpack:"id" json:"id"`
	OK     bool           `msgpack:"ok" json:"ok"`
	Result any            `msgpack:"result,omitempty" json:"result,omitempty"`
	Meta   map[string]any `msgpack:"meta,omitempty" json:"meta,omitempty"`
	Error  *ReplyError    `msgpack:"error,omitempty" json:"error,omitempty"`
}

// ReplyError carries a stable code to branch on, and a message for people.
type ReplyError struct {
	Code    string `msgpack:"code" json:"code"`
	Message string `msgpack:"message" json:"message"`
}

func getenv(name, fallback string) string {
	if value, ok := os.LookupEnv(name); ok {
		return value
	}
	return fallback
}

func newID() string {
	b := make([]byte, 16)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return hex.EncodeToString(b)
}

// submit enqueues one request and returns its id.
func submit(ctx context.Context, rdb *redis.Client, model, text string) (string, error) {
	payload, err := msgpack.Marshal(map[string]string{"text": text})
	if err != nil {
		return "", err
	}
	id := newID()
	err = rdb.XAdd(ctx, &redis.XAddArgs{
		Stream: namespace + ":requests:" + model,
		Values: map[string]any{"id": id, "payload": payload, "content_type": "application/msgpack"},
	}).Err()
	return id, err
}

// wait pops the reply of one request, or reports a timeout.
func wait(ctx context.Context, rdb *redis.Client, id string, timeout time.Duration) (Envelope, error) {
	popped, err := rdb.BLPop(ctx, timeout, namespace+":reply:"+id).Result()
	if errors.Is(err, redis.Nil) {
		return Envelope{ID: id, Error: &ReplyError{"timeout", "no reply within " + timeout.String()}}, nil
	}
	if err != nil {
		return Envelope{}, err
	}
	var envelope Envelope
	err = msgpack.Unmarshal([]byte(popped[1]), &envelope)
	return envelope, err
}

func run(texts []string) error {
	ctx := context.Background()
	options, err := redis.ParseURL(getenv("REDIS_URL", "redis://127.0.0.1:6379/0"))
	if err != nil {
		return err
	}
	timeoutS, err := strconv.Atoi(getenv("TIMEOUT_S", "30"))
	if err != nil {
		return fmt.Errorf("TIMEOUT_S: %w", err)
	}
	options.ReadTimeout = time.Duration(timeoutS+5) * time.Second // outlasts the BLPOP
	rdb := redis.NewClient(options)
	defer rdb.Close()

	model := getenv("MODEL", "minilm")
	ids := make([]string, 0, len(texts))
	for _, text := range texts {
		id, err := submit(ctx, rdb, model, text)
		if err != nil {
			return err
		}
		ids = append(ids, id)
	}
	failed := 0
	for _, id := range ids {
		envelope, err := wait(ctx, rdb, id, time.Duration(timeoutS)*time.Second)
		if err != nil {
			return err
		}
		if !envelope.OK {
			failed++
		}
		line, err := json.Marshal(envelope)
		if err != nil {
			return err
		}
		fmt.Println(string(line))
	}
	if failed > 0 {
		return fmt.Errorf("%d of %d requests failed", failed, len(ids))
	}
	return nil
}

func main() {
	texts := os.Args[1:]
	if len(texts) == 0 {
		texts = []string{"Redis streams feed the batch worker."}
	}
	if err := run(texts); err != nil {
		fmt.Fprintln(os.Stderr, "redbatch:", err)
		os.Exit(1)
	}
}
