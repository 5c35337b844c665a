// A redbatch client in Go (protocol v1, docs/protocol.md): XADD each request onto the
// model's stream (pipelined), then BLPOP each request's reply key.
//
//	go run . "first text" "second text"
//	env: REDIS_URL (redis://127.0.0.1:6379/0), MODEL (minilm), CONTENT_TYPE
//	     (application/msgpack or application/json), TIMEOUT_S (30), ENCODING (float32:
//	     embeddings come back as little-endian float32 bytes; unset: a list of floats)
//
// Prints one reply envelope per line as JSON (embeddings as lists of numbers); exits 1 if
// any request failed or timed out.
// Libraries: redigo and vmihailenco/msgpack, both packaged by Debian (see ../README.md).
package main

import (
	"crypto/rand"
	"encoding/base64"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"strconv"
	"time"

	"github.com/gomodule/redigo/redis"
	"github.com/vmihailenco/msgpack/v5"
)

const (
	namespace   = "redbatch"
	jsonType    = "application/json"
	msgpackType = "application/msgpack"
)

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

func newID() (string, error) {
	b := make([]byte, 16)
	if _, err := rand.Read(b); err != nil {
		return "", err
	}
	return hex.EncodeToString(b), nil
}

func encodePayload(contentType string, payload map[string]string) ([]byte, error) {
	if contentType == jsonType {
		return json.Marshal(payload)
	}
	return msgpack.Marshal(payload)
}

// decodeEnvelope reads a reply, encoded like its request: JSON envelopes start with "{".
func decodeEnvelope(data []byte) (Envelope, error) {
	var envelope Envelope
	if len(data) > 0 && data[0] == '{' {
		return envelope, json.Unmarshal(data, &envelope)
	}
	return envelope, msgpack.Unmarshal(data, &envelope)
}

// decodeEmbedding turns a float32 embedding (msgpack bin, or base64 text in a JSON reply)
// into numbers; a list of floats is returned as it is.
func decodeEmbedding(value any) (any, error) {
	var raw []byte
	switch v := value.(type) {
	case []byte:
		raw = v
	case string:
		decoded, err := base64.StdEncoding.DecodeString(v)
		if err != nil {
			return nil, fmt.Errorf("embedding: %w", err)
		}
		raw = decoded
	default:
		return value, nil
	}
	if len(raw)%4 != 0 {
		return nil, fmt.Errorf("embedding: %d bytes is not a float32 vector", len(raw))
	}
	vector := make([]float64, len(raw)/4)
	for i := range vector {
		vector[i] = float64(math.Float32frombits(binary.LittleEndian.Uint32(raw[4*i:])))
	}
	return vector, nil
}

// withEmbedding decodes the embedding of a successful reply in place.
func withEmbedding(envelope Envelope) (Envelope, error) {
	result, ok := envelope.Result.(map[string]any)
	if !envelope.OK || !ok || result["embedding"] == nil {
		return envelope, nil
	}
	vector, err := decodeEmbedding(result["embedding"])
	result["embedding"] = vector
	return envelope, err
}

// submit enqueues every text in one pipeline and returns the request ids in order.
func submit(conn redis.Conn, model, contentType, encoding string, texts []string) ([]string, error) {
	ids := make([]string, 0, len(texts))
	for _, text := range texts {
		fields := map[string]string{"text": text}
		if encoding != "" {
			fields["encoding"] = encoding
		}
		payload, err := encodePayload(contentType, fields)
		if err != nil {
			return nil, err
		}
		id, err := newID()
		if err != nil {
			return nil, err
		}
		err = conn.Send("XADD", namespace+":requests:"+model, "*",
			"id", id, "payload", payload, "content_type", contentType)
		if err != nil {
			return nil, err
		}
		ids = append(ids, id)
	}
	if err := conn.Flush(); err != nil {
		return nil, err
	}
	for range ids {
		if _, err := redis.String(conn.Receive()); err != nil {
			return nil, fmt.Errorf("XADD: %w", err)
		}
	}
	return ids, nil
}

// wait pops the reply of one request, or reports a timeout.
func wait(conn redis.Conn, id string, timeoutS int) (Envelope, error) {
	popped, err := redis.ByteSlices(conn.Do("BLPOP", namespace+":reply:"+id, timeoutS))
	if errors.Is(err, redis.ErrNil) {
		message := fmt.Sprintf("no reply within %d s", timeoutS)
		return Envelope{ID: id, Error: &ReplyError{"timeout", message}}, nil
	}
	if err != nil {
		return Envelope{}, err
	}
	envelope, err := decodeEnvelope(popped[1])
	if err != nil {
		return envelope, err
	}
	return withEmbedding(envelope)
}

func run(texts []string) error {
	timeoutS, err := strconv.Atoi(getenv("TIMEOUT_S", "30"))
	if err != nil {
		return fmt.Errorf("TIMEOUT_S: %w", err)
	}
	contentType := getenv("CONTENT_TYPE", msgpackType)
	if contentType != msgpackType && contentType != jsonType {
		return fmt.Errorf("CONTENT_TYPE: %q is neither %s nor %s", contentType, msgpackType, jsonType)
	}
	conn, err := redis.DialURL(getenv("REDIS_URL", "redis://127.0.0.1:6379/0"),
		redis.DialConnectTimeout(5*time.Second),
		redis.DialReadTimeout(time.Duration(timeoutS+5)*time.Second)) // outlasts the BLPOP
	if err != nil {
		return err
	}
	defer conn.Close()

	ids, err := submit(conn, getenv("MODEL", "minilm"), contentType, getenv("ENCODING", ""), texts)
	if err != nil {
		return err
	}
	failed := 0
	for _, id := range ids {
		envelope, err := wait(conn, id, timeoutS)
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
