// openai_client.mjs: the official `openai` npm package as a black-box client of `petrel serve`.
// usage: node openai_client.mjs PORT API_KEY [TOOLS_PORT]
// Exercises completions and chat, streamed and not, usage, n > 1, logprobs and errors; with
// TOOLS_PORT (a server whose answers are forced to tool-call markup, the test seam
// serve_opts.force_answer) also tools: tool_calls parsed by the client, streamed deltas
// accumulated, and the call and its result sent back as history. Prints one line per check and
// exits non-zero on the first failure.
import OpenAI from "openai";

const [port, apiKey, toolsPort] = process.argv.slice(2);
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

const nc = await client.completions.create({ model, prompt: "The os module provides", max_tokens: 8, temperature: 0.9, seed: 3, n: 3 });
check(nc.choices.length === 3 && nc.choices.map((x) => x.index).sort().join() === "0,1,2", "completions n=3");
const one = await client.completions.create({ model, prompt: "The os module provides", max_tokens: 8, temperature: 0.9, seed: 4 });
check(nc.choices.find((x) => x.index === 1).text === one.choices[0].text, "completions n=3: choice 1 == seed + 1 alone");
const lp = await client.chat.completions.create({ model, messages, max_tokens: 6, temperature: 0, logprobs: true, top_logprobs: 2 });
const lc = lp.choices[0].logprobs.content;
check(lc.length === lp.usage.completion_tokens && lc.every((t) => t.logprob <= 0 && t.top_logprobs.length === 2 && t.top_logprobs[0].logprob === t.logprob), "chat logprobs");
const slp = [];
const lps = await client.chat.completions.create({ model, messages, max_tokens: 6, temperature: 0, logprobs: true, stream: true });
for await (const ch of lps) for (const t of ch.choices[0]?.logprobs?.content ?? []) slp.push(t.logprob);
check(slp.length === lc.length && slp.every((v, i) => v === lc[i].logprob), "chat logprobs stream == non-stream");

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
await expectError(() => client.chat.completions.create({ model, messages, tools: [{ type: "nope" }] }), 400, "bad tools");

if (toolsPort) {
  const tc = new OpenAI({ baseURL: `http://127.0.0.1:${toolsPort}/v1`, apiKey, maxRetries: 0, timeout: 60000 });
  const tools = [{ type: "function", function: { name: "get_weather", description: "Weather of a city",
    parameters: { type: "object", properties: { city: { type: "string" }, days: { type: "integer" } }, required: ["city"] } } }];
  const q = [{ role: "user", content: "Weather in Paris?" }];
  const kw = { chat_template_kwargs: { enable_thinking: false } };
  const t1 = await tc.chat.completions.create({ model, messages: q, tools, max_tokens: 100, ...kw });
  const call = t1.choices[0].message.tool_calls?.[0];
  check(t1.choices[0].finish_reason === "tool_calls" && call?.type === "function" && call.function.name === "get_weather" &&
        JSON.parse(call.function.arguments).city === "Paris" && JSON.parse(call.function.arguments).days === 3, "tools: tool_calls");
  const acc = {};
  let tfinish = null;
  const ts = await tc.chat.completions.create({ model, messages: q, tools, max_tokens: 100, stream: true, ...kw });
  for await (const ch of ts) {
    for (const d of ch.choices[0]?.delta?.tool_calls ?? []) {
      acc[d.index] ??= { id: d.id, name: "", arguments: "" };
      if (d.function?.name) acc[d.index].name += d.function.name;
      if (d.function?.arguments) acc[d.index].arguments += d.function.arguments;
    }
    if (ch.choices[0]?.finish_reason) tfinish = ch.choices[0].finish_reason;
  }
  check(tfinish === "tool_calls" && acc[0]?.name === "get_weather" && acc[0].arguments === call.function.arguments, "tools: streamed tool_calls == non-stream");
  const t2 = await tc.chat.completions.create({ model, tools, max_tokens: 4, ...kw,
    messages: [...q, t1.choices[0].message, { role: "tool", tool_call_id: call.id, content: "sunny, 21 C" }] });
  check(t2.usage.prompt_tokens > t1.usage.prompt_tokens, "tools: the call and its result as history");
}
console.log("all ok");
