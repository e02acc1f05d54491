// A chat page on the Vercel AI SDK's useChat, talking to dialog-worker's gateway: the stock
// hook and transport, plus the gateway's address and a session token from this example's
// backend (server.py). What the gateway sends: docs/http.md, "With useChat".
import { useChat } from "@ai-sdk/react";
import { DefaultChatTransport, lastAssistantMessageIsCompleteWithApprovalResponses } from "ai";
import { useEffect, useRef, useState } from "react";
import { createRoot } from "react-dom/client";

// The gateway's routes are on this page's origin (server.py mounts them); a gateway of its own
// origin goes here, with this page's origin in its DIALOG_HTTP_CORS_ORIGINS.
const GATEWAY = "";
const TOKEN_URL = "/session-token";

// {session_id, token, expires_at} for this browser's own session, from the backend.
async function fetchToken() {
  const r = await fetch(TOKEN_URL, { method: "POST" });
  if (!r.ok) throw new Error(`no token: ${r.status}`);
  return r.json();
}

// A W3C traceparent of a new trace for each request: a gateway that traces continues it.
function newTraceparent() {
  const hex = (n) => Array.from(crypto.getRandomValues(new Uint8Array(n)), (b) => b.toString(16).padStart(2, "0")).join("");
  return `00-${hex(16)}-${hex(8)}-01`;
}

// The conversation is the page's to keep (the gateway resumes an answer, not a chat).
const stored = (session) => JSON.parse(localStorage.getItem(`chat:${session}`) || "[]");
const store = (session, messages) => localStorage.setItem(`chat:${session}`, JSON.stringify(messages));

function App() {
  const [grant, setGrant] = useState(null);
  const [failed, setFailed] = useState(null);
  useEffect(() => {
    fetchToken().then(setGrant, (e) => setFailed(String(e)));
  }, []);
  if (failed) return <p data-testid="failed">{failed}</p>;
  if (!grant) return <p>Connecting...</p>;
  return <Chat grant={grant} renew={() => fetchToken().then(setGrant)} />;
}

function Chat({ grant, renew }) {
  const session = grant.session_id;
  const token = useRef(grant.token);
  token.current = grant.token;
  // A new token before this one expires (the transport reads it at each request).
  useEffect(() => {
    const ms = Math.max(5_000, grant.expires_at * 1000 - Date.now() - 60_000);
    const timer = setTimeout(renew, ms);
    return () => clearTimeout(timer);
  }, [grant]);
  const [transport] = useState(
    () =>
      new DefaultChatTransport({
        api: `${GATEWAY}/ai-sdk/chat`,
        headers: () => ({ Authorization: `Bearer ${token.current}`, traceparent: newTraceparent() }),
      }),
  );
  const { messages, sendMessage, status, error, regenerate, addToolApprovalResponse } = useChat({
    id: session,
    messages: stored(session),
    resume: true,
    transport,
    sendAutomaticallyWhen: lastAssistantMessageIsCompleteWithApprovalResponses,
  });
  useEffect(() => store(session, messages), [messages]);
  // After a reload: a last message sent but not yet taken up by a worker has no answer being
  // written (the resume found none); sent again, it is the same message, answered once.
  const checked = useRef(false);
  useEffect(() => {
    if (checked.current || status !== "ready") return;
    checked.current = true;
    if (messages.at(-1)?.role === "user") regenerate();
  }, [status]);

  const [input, setInput] = useState("");
  const [policy, setPolicy] = useState("enqueue");
  const submit = (e) => {
    e.preventDefault();
    if (!input.trim()) return;
    // While an answer is being written a second message opens a second stream; what it does
    // to the first is the double-texting policy.
    sendMessage({ text: input }, { body: { multitask: policy } });
    setInput("");
  };
  // Stop: the gateway stops the answer (useChat's own stop() only closes the connection).
  const stop = () => {
    const last = [...messages].reverse().find((m) => m.role === "user");
    fetch(`${GATEWAY}/ai-sdk/chat/${encodeURIComponent(session)}/stop`, {
      method: "POST",
      headers: { Authorization: `Bearer ${token.current}`, "Content-Type": "application/json" },
      body: JSON.stringify(last ? { messageId: last.id } : {}),
    });
  };
  const writing = status === "submitted" || status === "streaming";
  return (
    <main>
      <h1>Chat</h1>
      <ol id="log" data-testid="log">
        {messages.map((m) => (m.role === "user" ? <User key={m.id} message={m} /> : <Answer key={m.id} message={m} answer={addToolApprovalResponse} />))}
      </ol>
      {error && <p className="error" data-testid="error">{error.message}</p>}
      <form onSubmit={submit}>
        <input data-testid="input" value={input} onChange={(e) => setInput(e.target.value)} placeholder="Say something" autoFocus />
        <select data-testid="policy" value={policy} onChange={(e) => setPolicy(e.target.value)} title="If an answer is still being written">
          <option value="enqueue">wait for it</option>
          <option value="interrupt">stop it</option>
          <option value="reject">do not send</option>
          <option value="coalesce">replace waiting ones</option>
        </select>
        <button data-testid="send">Send</button>
        <button type="button" data-testid="stop" onClick={stop} disabled={!writing}>Stop</button>
      </form>
      <p className="status" data-testid="status">{status}</p>
    </main>
  );
}

const User = ({ message }) => (
  <li className="user" data-testid="user">{message.parts.filter((p) => p.type === "text").map((p) => p.text).join("")}</li>
);

// How an answer that ended otherwise than applied is marked.
const OUTCOMES = {
  cancelled: "(stopped)",
  rejected: "(not answered: an answer was still being written)",
  superseded: "(not answered: replaced by your next message)",
  expired: "(not answered in time)",
};

function Answer({ message, answer }) {
  // An answer that started over: the parts after the last data-reset replace those before.
  const from = message.parts.findLastIndex((p) => p.type === "data-reset") + 1;
  const parts = message.parts.slice(from);
  const text = parts.filter((p) => p.type === "text").map((p) => p.text).join("");
  // Tool progress: the newest status of each tool.
  const tools = new Map(parts.filter((p) => p.type === "data-tool").map((p) => [p.data.name, p.data.status]));
  const questions = message.parts.filter((p) => p.type === "dynamic-tool" && p.toolName === "interrupt");
  const outcome = message.metadata?.outcome;
  return (
    <li className="bot" data-testid="answer" data-outcome={outcome || ""}>
      {[...tools].map(([name, state]) => <div className="tool" key={name} data-testid="tool">{name}: {state}</div>)}
      <span data-testid="text">{text}</span>
      {OUTCOMES[outcome] && <em data-testid="outcome"> {OUTCOMES[outcome]}</em>}
      {questions.map((q) => (
        <div className="question" key={q.toolCallId} data-testid="question" data-state={q.state}>
          {q.input?.question ?? JSON.stringify(q.input)}
          {q.state === "approval-requested" && (
            <>
              <button data-testid="approve" onClick={() => answer({ id: q.approval.id, approved: true })}>Approve</button>
              <button data-testid="reject" onClick={() => answer({ id: q.approval.id, approved: false })}>Reject</button>
            </>
          )}
        </div>
      ))}
    </li>
  );
}

createRoot(document.getElementById("root")).render(<App />);
