// The AI SDK's own client code against the gateway's /ai-sdk/chat: DefaultChatTransport sends
// and reconnects exactly as useChat does, readUIMessageStream builds the assistant message
// from the chunks. One JSON argument says what to do; one JSON line on stdout says what came.
//
//   {"mode": "send", "base": URL, "token": T, "chat": ID, "messages": [...], "body": {...},
//    "stopAfterChunks": N}
//   {"mode": "resume", "base": URL, "token": T, "chat": ID}
//   {"mode": "mint", "key": K, "sub": S, "scope": "send stream", "ttl": "5m"}
import { DefaultChatTransport, readUIMessageStream } from "ai";
import { SignJWT } from "jose";

const spec = JSON.parse(process.argv[2]);

function transport() {
  return new DefaultChatTransport({
    api: `${spec.base}/ai-sdk/chat`,
    headers: { Authorization: `Bearer ${spec.token}` },
    body: spec.body,
  });
}

// Reads a chunk stream to its end: every chunk, the message readUIMessageStream last built
// (on `last`, the assistant message it continues, as useChat does), and the text of each
// message it built (how the text grew).
async function read(stream, last) {
  const [forChunks, forMessages] = stream.tee();
  const chunks = [];
  const seen = (async () => {
    for await (const chunk of forChunks) chunks.push(chunk);
  })();
  const texts = [];
  const errors = [];
  let message = null;
  for await (const m of readUIMessageStream({ stream: forMessages, message: last, onError: (e) => errors.push(String(e)) })) {
    message = m;
    texts.push(m.parts.filter((p) => p.type === "text").map((p) => p.text).join(""));
  }
  await seen;
  return { chunks, message, texts, errors };
}

// The first `count` chunks, then the connection drops (the page is reloaded).
async function readSome(stream, count, abort) {
  const chunks = [];
  for await (const chunk of stream) {
    chunks.push(chunk);
    if (chunks.length >= count) break;
  }
  abort.abort();
  return { chunks };
}

async function main() {
  if (spec.mode === "mint") {
    const token = await new SignJWT({ scope: spec.scope })
      .setProtectedHeader({ alg: "HS256" })
      .setSubject(spec.sub)
      .setIssuedAt()
      .setExpirationTime(spec.ttl)
      .sign(new TextEncoder().encode(spec.key));
    return { token };
  }
  const abort = new AbortController();
  if (spec.mode === "send") {
    let stream;
    try {
      stream = await transport().sendMessages({
        chatId: spec.chat,
        messages: spec.messages,
        trigger: spec.trigger ?? "submit-message",
        messageId: spec.messageId,
        abortSignal: abort.signal,
      });
    } catch (e) {
      return { refused: String(e.message) };
    }
    const last = spec.messages.at(-1);
    const continued = last.role === "assistant" ? structuredClone(last) : undefined;
    return spec.stopAfterChunks ? await readSome(stream, spec.stopAfterChunks, abort) : await read(stream, continued);
  }
  if (spec.mode === "resume") {
    const stream = await transport().reconnectToStream({ chatId: spec.chat, abortSignal: abort.signal });
    if (stream === null) return { none: true };
    return spec.stopAfterChunks ? await readSome(stream, spec.stopAfterChunks, abort) : await read(stream);
  }
  throw new Error(`unknown mode ${spec.mode}`);
}

main().then(
  (out) => { process.stdout.write(JSON.stringify(out) + "\n"); process.exit(0); },
  (e) => { process.stderr.write(String(e.stack || e) + "\n"); process.exit(1); },
);
