// A redbatch client in Node.js (protocol v1, docs/protocol.md): XADD each request onto the
// model's stream, then BLPOP each request's reply key.
//
//   npm ci && node client.mjs "first text" "second text"
//   env: REDIS_URL (redis://127.0.0.1:6379/0), MODEL (minilm), CONTENT_TYPE
//        (application/msgpack or application/json), TIMEOUT_S (30), ENCODING (float32:
//        embeddings come back as little-endian float32 bytes; unset: a list of floats)
// Prints one reply envelope per line as JSON (embeddings as lists of numbers); exits 1 if
// any request failed or timed out.
import { randomUUID } from "node:crypto";
import { decode, encode } from "@msgpack/msgpack";
import { createClient, RESP_TYPES } from "redis";

const url = process.env.REDIS_URL ?? "redis://127.0.0.1:6379/0";
const model = process.env.MODEL ?? "minilm";
const contentType = process.env.CONTENT_TYPE ?? "application/msgpack";
const timeoutS = Number(process.env.TIMEOUT_S ?? 30);
const encoding = process.env.ENCODING; // "float32", or unset for lists of floats
const namespace = "redbatch";

const encodePayload = (value) =>
  contentType === "application/json" ? Buffer.from(JSON.stringify(value)) : Buffer.from(encode(value));

// A reply is encoded like its request: JSON envelopes start with "{".
const decodeEnvelope = (data) => (data[0] === 0x7b ? JSON.parse(data.toString("utf8")) : decode(data));

// A float32 embedding: msgpack bin (a Uint8Array), or base64 text in a JSON reply.
function decodeEmbedding(value) {
  if (typeof value !== "string" && !(value instanceof Uint8Array)) return value;
  const bytes = typeof value === "string" ? Buffer.from(value, "base64") : Buffer.from(value);
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  return Array.from({ length: bytes.byteLength / 4 }, (_, i) => view.getFloat32(4 * i, true));
}

function withEmbedding(envelope) {
  if (envelope.ok && envelope.result && envelope.result.embedding !== undefined) {
    envelope.result.embedding = decodeEmbedding(envelope.result.embedding);
  }
  return envelope;
}

async function main(texts) {
  // Replies are binary (msgpack): read blob strings as Buffers.
  const client = createClient({ url }).withTypeMapping({ [RESP_TYPES.BLOB_STRING]: Buffer });
  client.on("error", (err) => console.error("redis:", err.message));
  await client.connect();
  try {
    const ids = texts.map(() => randomUUID());
    // Enqueue everything first: node-redis pipelines commands sent in the same tick.
    await Promise.all(ids.map((id, i) =>
      client.xAdd(`${namespace}:requests:${model}`, "*", {
        id,
        payload: encodePayload(encoding ? { text: texts[i], encoding } : { text: texts[i] }),
        content_type: contentType,
      })));
    let failed = 0;
    for (const id of ids) {
      const popped = await client.blPop(`${namespace}:reply:${id}`, timeoutS);
      const envelope = popped
        ? withEmbedding(decodeEnvelope(popped.element))
        : { id, ok: false, error: { code: "timeout", message: `no reply within ${timeoutS} s` } };
      if (!envelope.ok) failed += 1;
      console.log(JSON.stringify(envelope));
    }
    return failed === 0 ? 0 : 1;
  } finally {
    await client.quit();
  }
}

const texts = process.argv.slice(2);
process.exitCode = await main(texts.length ? texts : ["Redis streams feed the batch worker."]);
