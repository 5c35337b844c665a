// A streamed answer from a generative model in Node.js (protocol v1, docs/protocol.md,
// "Generative models"): XADD the request, then XREAD BLOCK its reply stream until the
// `done` entry.
//
//   npm ci && node stream.mjs "What is the capital of France?"
//   env: REDIS_URL (redis://127.0.0.1:6379/0), MODEL (smollm2), MAX_NEW_TOKENS (48),
//        CONTENT_TYPE (application/msgpack or application/json), TIMEOUT_S (60)
// Prints the answer's text as it streams, then a newline; exits 1 on an error `done` entry
// or when no `done` entry came within TIMEOUT_S.
import { randomUUID } from "node:crypto";
import { decode, encode } from "@msgpack/msgpack";
import { createClient, RESP_TYPES } from "redis";

const url = process.env.REDIS_URL ?? "redis://127.0.0.1:6379/0";
const model = process.env.MODEL ?? "smollm2";
const maxNewTokens = Number(process.env.MAX_NEW_TOKENS ?? 48);
const contentType = process.env.CONTENT_TYPE ?? "application/msgpack";
const timeoutS = Number(process.env.TIMEOUT_S ?? 60);
const namespace = "redbatch";

const encodePayload = (value) =>
  contentType === "application/json" ? Buffer.from(JSON.stringify(value)) : Buffer.from(encode(value));

// An envelope is encoded like its request: JSON envelopes start with "{".
const decodeEnvelope = (data) => (data[0] === 0x7b ? JSON.parse(data.toString("utf8")) : decode(data));

// Print each delta's text as it arrives; resolve to the `done` envelope (null on timeout).
async function stream(client, key) {
  let last = "0-0";
  const deadline = Date.now() + timeoutS * 1000;
  while (Date.now() < deadline) {
    const reply = await client.xRead({ key, id: last }, { COUNT: 100, BLOCK: 1000 });
    for (const { messages } of reply ?? []) {
      for (const { id, message } of messages) {
        last = id.toString();
        const envelope = decodeEnvelope(message.data);
        if (envelope.type === "done") return envelope;
        process.stdout.write(envelope.text);
      }
    }
  }
  return null;
}

async function main(question) {
  // Envelopes may be binary (msgpack): read blob strings as Buffers.
  const client = createClient({ url }).withTypeMapping({ [RESP_TYPES.BLOB_STRING]: Buffer });
  client.on("error", (err) => console.error("redis:", err.message));
  await client.connect();
  try {
    const id = randomUUID();
    await client.xAdd(`${namespace}:requests:${model}`, "*", {
      id,
      content_type: contentType,
      payload: encodePayload({
        messages: [{ role: "user", content: question }],
        max_new_tokens: maxNewTokens,
      }),
    });
    const key = `${namespace}:stream:${id}`;
    const done = await stream(client, key);
    process.stdout.write("\n");
    if (done === null) {
      console.error(`error: no answer on ${key} within ${timeoutS} s`);
      return 1;
    }
    if (!done.ok) {
      console.error(`error: ${done.error.code}: ${done.error.message}`);
      return 1;
    }
    console.error(`(${done.result.tokens} tokens, finish_reason ${done.result.finish_reason})`);
    return 0;
  } finally {
    await client.quit();
  }
}

const question = process.argv.slice(2).join(" ") || "What is the capital of France?";
process.exitCode = await main(question);
