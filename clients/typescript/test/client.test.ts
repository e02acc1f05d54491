// The client against a real gateway and real workers (GATEWAY_URL, GATEWAY_TOKEN, SESSION_TOKEN
// set by tests/integration/test_typescript_client.py; engine: tests/support/chat_engines.py),
// and its event-stream parser on its own.
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { describe, test } from "node:test";

import { type AnswerEvent, DialogClient, GatewayError, parseSSE } from "../src/index.js";

const words = (n: number): string => Array.from({ length: n }, (_, i) => `w${i} `).join("");

function shown(events: AnswerEvent[]): string {
  let text = "";
  for (const event of events) {
    if (event.kind === "delta") text += event.text;
    else if (event.kind === "reset") text = "";
    else if (event.kind === "resync" || event.kind === "end") text = event.text;
  }
  return text;
}

function body(...chunks: string[]): ReadableStream<Uint8Array> {
  const encoder = new TextEncoder();
  return new ReadableStream({
    start(controller) {
      for (const chunk of chunks) controller.enqueue(encoder.encode(chunk));
      controller.close();
    },
  });
}

describe("parseSSE", () => {
  test("reads events split anywhere, CRLF or LF, skipping comments", async () => {
    const events = [];
    for await (const event of parseSSE(
      body(
        "retry: 1000\n\nid: a:1:0\r\nevent: del",
        'ta\r\ndata: {"x"',
        ": 1}\r\n\r",
        "\n",
        ": keep-alive\n\n",
        "event: reset\ndata: {}\n\n",
        "event: cut\ndata: {",
      ),
    )) {
      events.push(event);
    }
    assert.deepEqual(events, [
      { event: "delta", data: '{"x": 1}', id: "a:1:0" },
      { event: "reset", data: "{}", id: undefined },
    ]);
  });
});

const url = process.env.GATEWAY_URL;
const live = { skip: url === undefined ? "GATEWAY_URL is not set" : false };

describe("against the gateway", live, () => {
  const client = new DialogClient({ baseUrl: url ?? "", token: process.env.GATEWAY_TOKEN ?? "" });
  const session = (): string => `ts-${randomUUID()}`;

  async function collect(stream: AsyncIterable<AnswerEvent>, stopAfter = 0): Promise<AnswerEvent[]> {
    const events: AnswerEvent[] = [];
    for await (const event of stream) {
      events.push(event);
      if (stopAfter && events.length === stopAfter) break;
    }
    return events;
  }

  test("send, then stream the answer to its end", async () => {
    const sid = session();
    const sent = await client.send(sid, "words 30 5");
    assert.equal(sent.stream, `/sessions/${sid}/messages/${sent.msg_id}/stream`);
    const events = await collect(client.stream(sid, sent.msg_id));
    const end = events.at(-1);
    assert.equal(end?.kind, "end");
    assert.equal(end?.kind === "end" && end.outcome, "applied");
    assert.equal(shown(events), words(30));
    assert.equal(
      events
        .filter((e) => e.kind === "delta")
        .map((e) => e.text)
        .join(""),
      words(30),
    );
  });

  test("a stream resumed from a cursor gets each piece once", async () => {
    const sid = session();
    const sent = await client.send(sid, "words 40 20");
    const first = await collect(client.stream(sid, sent.msg_id), 2);
    const last = first.at(-1);
    assert.ok(last && "cursor" in last);
    const rest = await collect(client.stream(sid, sent.msg_id, { after: last.cursor }));
    assert.equal(shown([...first, ...rest.slice(0, -1)]), words(40));
    const end = rest.at(-1);
    assert.ok(end?.kind === "end");
    const again = await collect(client.stream(sid, sent.msg_id, { after: end.cursor }));
    assert.deepEqual(again, []); // the end's own cursor: nothing is live after it
  });

  test("cancel stops a running answer; its end says so", async () => {
    const sid = session();
    const sent = await client.send(sid, "words 400 40");
    const events: AnswerEvent[] = [];
    for await (const event of client.stream(sid, sent.msg_id)) {
      events.push(event);
      if (events.length === 2) {
        const cancelled = await client.cancel(sid, sent.msg_id);
        assert.equal(cancelled.status, "cancelled");
      }
    }
    const end = events.at(-1);
    assert.equal(end?.kind === "end" && end.outcome, "cancelled");
    assert.ok(shown(events).length < words(400).length);
    assert.equal((await client.cancel(sid, sent.msg_id)).status, "finished");
  });

  test("pending and resume answer what the step waits on, once", async () => {
    const sid = session();
    const sent = await client.send(sid, "ask");
    const events: AnswerEvent[] = [];
    let asked: string | undefined;
    for await (const event of client.stream(sid, sent.msg_id)) {
      events.push(event);
      if (event.kind === "event" && event.event_kind === "awaiting") {
        const [waiting] = await client.pending(sid);
        assert.ok(waiting);
        assert.deepEqual(waiting.payload, { question: "go on?" });
        asked = waiting.interrupt_id;
        assert.equal((await client.resume(sid, asked, { ok: 1 })).status, "resumed");
        assert.equal((await client.resume(sid, asked, "again")).status, "already_resumed");
      }
    }
    assert.ok(asked);
    assert.equal(shown(events), 'approved {"ok": 1}');
    assert.deepEqual(await client.pending(sid), []);
    assert.equal((await client.resume(sid, "nope:1:1", true)).status, "unknown");
  });

  test("events follow the session's turns", async () => {
    const sid = session();
    const abort = new AbortController();
    const sent = await client.send(sid, "hello");
    for await (const event of client.events(sid, { signal: abort.signal })) {
      if (event.kind === "turn" && event.data.msg_id === sent.msg_id) {
        assert.equal(event.data.bot, "echo hello");
        assert.equal(event.data.user, "hello");
        abort.abort();
      }
    }
  });

  test("refusals are GatewayErrors with the gateway's reason", async () => {
    const stranger = new DialogClient({ baseUrl: url ?? "", token: "wrong" });
    await assert.rejects(stranger.send(session(), "hi"), (error: unknown) => {
      assert.ok(error instanceof GatewayError);
      assert.equal(error.status, 401);
      return true;
    });
    await assert.rejects(client.send(session(), "   "), (error: unknown) => {
      assert.ok(error instanceof GatewayError && error.status === 400);
      assert.match(error.message, /text/);
      return true;
    });
    const scoped = new DialogClient({
      baseUrl: url ?? "",
      token: () => process.env.SESSION_TOKEN ?? "",
    });
    await assert.rejects(scoped.pending("not-its-session"), (error: unknown) => {
      assert.ok(error instanceof GatewayError && error.status === 403);
      return true;
    });
    await assert.rejects(
      collect(client.stream(session(), "m1", { after: "not-a-cursor" })),
      (error: unknown) => error instanceof GatewayError && error.status === 400,
    );
  });
});
