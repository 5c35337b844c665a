// Embeddings from a redbatch gateway with the official `openai` package (npm install openai).
// OPENAI_BASE_URL (default http://localhost:8000/v1), OPENAI_API_KEY (any value when the
// gateway has no keys set), MODEL (default minilm); the texts are the arguments.
// Prints the response as one JSON object.
import OpenAI from "openai";

const client = new OpenAI({
  baseURL: process.env.OPENAI_BASE_URL ?? "http://localhost:8000/v1",
  apiKey: process.env.OPENAI_API_KEY ?? "unused",
  maxRetries: 0,
});

const texts = process.argv.slice(2);
const response = await client.embeddings.create({
  model: process.env.MODEL ?? "minilm",
  input: texts.length ? texts : ["Hello from Node.js"],
  // The SDK asks for base64 by default and decodes it into floats: the gateway supports both.
});
console.log(JSON.stringify(response));
