// The LangGraph JS SDK (@langchain/langgraph-sdk), unmodified, against the gateway's
// /langgraph routes and real workers (engine: tests/support/chat_engines.py). Started by
// tests/integration/test_gateway_langgraph_js.py with LANGGRAPH_URL and GATEWAY_TOKEN set.
import assert from "node:assert/strict";
import { test } from "node:test";

import { Client } from "@langchain/langgraph-sdk";

const client = new Client({
  apiUrl: process.env.LANGGRAPH_URL,
  apiKey: process.env.GATEWAY_TOKEN,
});

const user = (text) => ({ messages: [{ type: "human", content: text }] });
const words = (n) => Array.from({ length: n }, (_, i) => `w${i} `).join("");

async function collect(parts) {
  const all = [];
  for await (const part of parts) all.push(part);
  return all;
}

function streamedText(parts) {
  return parts
    .filter((p) => p.event === "messages")
    .map((p) => p.data[0].content)
    .join("");
}

async function assistantId() {
  const found = await client.assistants.search();
  assert.equal(found.length, 1);
  return found[0].assistant_id;
}

test("a run streams values, updates and message chunks, and the thread keeps it", async () => {
  const assistant = await assistantId();
  const thread = await client.threads.create();
  let created;
  const parts = await collect(
    client.runs.stream(thread.thread_id, assistant, {
      input: user("words 25 5"),
      streamMode: ["values", "updates", "messages-tuple"],
      onRunCreated: (meta) => {
        created = meta;
      },
    }),
  );
  assert.equal(parts[0].event, "metadata");
  assert.deepEqual(created, { run_id: parts[0].data.run_id, thread_id: thread.thread_id });
  assert.equal(streamedText(parts), words(25));
  const values = parts.filter((p) => p.event === "values").at(-1).data;
  assert.deepEqual(
    values.messages.map((m) => [m.type, m.content]),
    [
      ["human", "words 25 5"],
      ["ai", words(25)],
    ],
  );
  const state = await client.threads.getState(thread.thread_id);
  assert.deepEqual(state.values, values);
  const history = await client.threads.getHistory(thread.thread_id);
  assert.equal(history.length, 1);
});

test("wait, create and join answer with the thread's values", async () => {
  const assistant = await assistantId();
  const { thread_id } = await client.threads.create();
  const waited = await client.runs.wait(thread_id, assistant, { input: user("hello") });
  assert.equal(waited.messages.at(-1).content, "echo hello");
  const run = await client.runs.create(thread_id, assistant, { input: user("again") });
  const joined = await client.runs.join(thread_id, run.run_id);
  assert.equal(joined.messages.at(-1).content, "echo again");
  assert.equal((await client.runs.get(thread_id, run.run_id)).status, "success");
});

test("an interrupt ends the run and a command resumes it", async () => {
  const assistant = await assistantId();
  const { thread_id } = await client.threads.create();
  const parts = await collect(
    client.runs.stream(thread_id, assistant, {
      input: user("ask"),
      streamMode: ["values", "custom"],
    }),
  );
  const interrupted = parts.filter((p) => p.event === "values").at(-1).data;
  assert.deepEqual(interrupted.__interrupt__[0].value, { question: "go on?" });
  assert.deepEqual(parts.find((p) => p.event === "custom").data, {
    kind: "tool",
    data: { name: "lookup", state: "done" },
  });
  const thread = await client.threads.get(thread_id);
  assert.equal(thread.status, "interrupted");

  const resumed = await collect(
    client.runs.stream(thread_id, assistant, {
      command: { resume: "yes" },
      streamMode: ["values", "messages-tuple"],
    }),
  );
  assert.equal(streamedText(resumed), "checking approved ");
  const final = resumed.filter((p) => p.event === "values").at(-1).data;
  assert.equal(final.messages.at(-1).content, 'approved "yes"');
});

test("cancel stops a running run; joinStream resumes from its last event id", async () => {
  const assistant = await assistantId();
  const { thread_id } = await client.threads.create();
  const run = await client.runs.create(thread_id, assistant, { input: user("words 400 40") });
  const seen = [];
  for await (const part of client.runs.joinStream(thread_id, run.run_id, {
    streamMode: "messages-tuple",
  })) {
    seen.push(part);
    if (seen.filter((p) => p.event === "messages").length === 3) break;
  }
  const rest = [];
  for await (const part of client.runs.joinStream(thread_id, run.run_id, {
    streamMode: "messages-tuple",
    lastEventId: seen.at(-1).id,
  })) {
    rest.push(part);
    if (rest.filter((p) => p.event === "messages").length === 3) break;
  }
  // Each piece once, in order: the second stream starts where the first was cut.
  const shown = streamedText(seen) + streamedText(rest);
  assert.ok(words(400).startsWith(shown), shown);
  assert.ok(streamedText(rest).length > 0 && !streamedText(rest).startsWith("w0 "));

  await client.runs.cancel(thread_id, run.run_id, true);
  assert.equal((await client.runs.get(thread_id, run.run_id)).status, "interrupted");
  const last = (await client.threads.getState(thread_id)).values.messages.at(-1);
  assert.deepEqual(last.response_metadata, { outcome: "cancelled" });
});

test("an unknown stream mode and a forged run id are refused", async () => {
  const assistant = await assistantId();
  const { thread_id } = await client.threads.create();
  await assert.rejects(
    collect(client.runs.stream(thread_id, assistant, { input: user("x"), streamMode: "debug" })),
    /400/,
  );
  await assert.rejects(client.runs.get(thread_id, "forged-run"), /404/);
});
