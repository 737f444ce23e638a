// openai_client.mjs: the official `openai` npm package as a black-box client of `petrel serve`.
// usage: node openai_client.mjs PORT API_KEY
// Exercises completions and chat, streamed and not, usage, and errors; prints one line per
// check and exits non-zero on the first failure.
import OpenAI from "openai";

const [port, apiKey] = process.argv.slice(2);
const client = new OpenAI({ baseURL: `http://127.0.0.1:${port}/v1`, apiKey, maxRetries: 0, timeout: 60000 });
function check(cond, what) {
  if (!cond) { console.log(`FAIL ${what}`); process.exit(1); }
  console.log(`ok ${what}`);
}

const models = await client.models.list();
check(models.data.length === 1 && typeof models.data[0].id === "string", "models.list");
const model = models.data[0].id;

const c = await client.completions.create({ model, prompt: "The os module provides", max_tokens: 12, temperature: 0 });
check(c.object === "text_completion" && typeof c.choices[0].text === "string" && c.choices[0].text.length > 0, "completions");
check(c.usage.prompt_tokens === 4 && c.usage.completion_tokens <= 12 && c.usage.total_tokens === c.usage.prompt_tokens + c.usage.completion_tokens, "completions usage");
check(["stop", "length"].includes(c.choices[0].finish_reason), "completions finish_reason");

let streamed = "", finish = null, usage = null;
const cs = await client.completions.create({ model, prompt: "The os module provides", max_tokens: 12, temperature: 0, stream: true, stream_options: { include_usage: true } });
for await (const ch of cs) {
  if (ch.usage) usage = ch.usage;
  if (ch.choices.length) { streamed += ch.choices[0].text; if (ch.choices[0].finish_reason) finish = ch.choices[0].finish_reason; }
}
check(streamed === c.choices[0].text, "completions stream == non-stream at temperature 0");
check(finish === c.choices[0].finish_reason && usage && usage.completion_tokens === c.usage.completion_tokens, "completions stream finish and usage");

const messages = [{ role: "system", content: "You are brief." }, { role: "user", content: "What does os.path.join do?" }];
const r = await client.chat.completions.create({ model, messages, max_tokens: 16, temperature: 0 });
check(r.object === "chat.completion" && r.choices[0].message.role === "assistant" && typeof r.choices[0].message.content === "string", "chat");
let text = "", reasoning = "", role = null, cfinish = null;
const st = await client.chat.completions.create({ model, messages, max_tokens: 16, temperature: 0, stream: true });
for await (const ch of st) {
  const d = ch.choices[0]?.delta ?? {};
  if (d.role) role = d.role;
  if (d.content) text += d.content;
  if (d.reasoning_content) reasoning += d.reasoning_content;
  if (ch.choices[0]?.finish_reason) cfinish = ch.choices[0].finish_reason;
}
check(role === "assistant" && text === r.choices[0].message.content && (r.choices[0].message.reasoning_content ?? "") === reasoning, "chat stream == non-stream");
check(cfinish === r.choices[0].finish_reason, "chat stream finish_reason");

async function expectError(fn, status, what) {
  try { await fn(); } catch (e) {
    check(e instanceof OpenAI.APIError && e.status === status && typeof e.message === "string", `${what} -> ${status}`);
    return;
  }
  check(false, `${what} -> ${status} (no error)`);
}
await expectError(() => client.completions.create({ model, prompt: "x", temperature: -3 }), 400, "bad temperature");
await expectError(() => client.chat.completions.create({ model: "no-such-model", messages }), 404, "unknown model");
await expectError(() => client.completions.create({ model, prompt: Array(5000).fill(300) }), 400, "prompt beyond the context");
const bad = new OpenAI({ baseURL: `http://127.0.0.1:${port}/v1`, apiKey: "wrong", maxRetries: 0 });
await expectError(() => bad.models.list(), 401, "wrong API key");
console.log("all ok");
