// A typed client of the dialog-worker HTTP gateway (docs/http.md), for browsers and Node 18+:
// send a message, stream its answer (resumed by cursor after a dropped connection), cancel it,
// follow a session's turns, and answer what the session waits on. The field names are the
// gateway's (its OpenAPI document: GET /openapi.json).
import { parseSSE } from "./sse.js";

export { parseSSE, type ServerEvent } from "./sse.js";

export type Multitask = "enqueue" | "reject" | "interrupt" | "coalesce" | "merge";

export type Outcome =
  | "applied"
  | "dead_lettered"
  | "duplicate"
  | "cancelled"
  | "rejected"
  | "superseded"
  | "expired"
  | "merged"
  | "budget_exceeded"
  | "awaiting";

export interface SendOptions {
  /** Reuse it to retry a send: the message is still applied once. A new one when absent. */
  msgId?: string;
  /** Extra text fields for the engine (`message["meta"]`). */
  meta?: Record<string, string>;
  /** What this message does while its session answers another. */
  multitask?: Multitask;
  /** Unix seconds: if its turn comes later, it ends `expired` without a step. */
  expiresAt?: number;
  /** Unix seconds (at most 366 days ahead): it joins its session's order then. */
  deliverAt?: number;
  signal?: AbortSignal;
}

export interface Sent {
  session_id: string;
  msg_id: string;
  entry_id: string;
  /** The path of the answer's stream. */
  stream: string;
}

interface AnswerBase {
  msg_id: string;
  attempt: number;
}

/** Append `text`. */
export interface Delta extends AnswerBase {
  kind: "delta";
  text: string;
  pos: number;
  cursor: string;
}

/** A new attempt starts the answer again: clear what you show. */
export interface Reset extends AnswerBase {
  kind: "reset";
  text: string;
}

/** You fell behind what is kept piece by piece: replace what you show with `text`. */
export interface Resync extends AnswerBase {
  kind: "resync";
  text: string;
  pos: number;
  cursor: string;
}

/** The committed reply (replace what you show); nothing follows. */
export interface End extends AnswerBase {
  kind: "end";
  text: string;
  outcome: Outcome;
  pos?: number;
  cursor: string;
}

/** A typed event the step sent beside its text (`emit_event`); `awaiting`: it waits for a
 * person, `data` is `{interrupt_id, payload}`. */
export interface TypedEvent extends AnswerBase {
  kind: "event";
  event_kind: string;
  data: unknown;
  pos: number;
  cursor: string;
}

/** The message waits for its model (its key's rate, or the key is paused): show "waiting for
 * the model" until the next event; `until_ms` is when it expects to go (epoch ms) or null. */
export interface Waiting extends AnswerBase {
  kind: "waiting";
  data: { reason: "rate" | "paused" | "slots" | "tenant_cap"; until_ms: number | null };
  pos: number;
  cursor: string;
}

export type AnswerEvent = Delta | Reset | Resync | End | TypedEvent | Waiting;

export interface Turn {
  seq: number;
  msg_id: string;
  outcome: Outcome;
  user: string | null;
  bot: string;
}

export type SessionEvent =
  | { kind: "turn"; cursor: string | undefined; data: Turn }
  | {
      kind: "awaiting";
      cursor: string | undefined;
      data: { seq: number; msg_id: string; interrupt_id: string; payload: unknown };
    }
  | {
      kind: "resync";
      cursor: string | undefined;
      data: { reason: "restart" | "gap"; turns: Turn[] };
    };

export interface CancelResult {
  session_id: string;
  msg_id: string;
  status: "cancelled" | "finished" | "pending";
  seq: number | null;
  outcome: Outcome | null;
}

export interface PendingInterrupt {
  session_id: string;
  interrupt_id: string;
  msg_id: string;
  seq: number;
  payload: unknown;
  created_at: number;
  timeout_at: number | null;
}

export interface ResumeResult {
  session_id: string;
  interrupt_id: string;
  status: "resumed" | "already_resumed" | "timed_out" | "cancelled" | "superseded" | "unknown";
}

/** A refusal of the gateway: `status` (400 bad input, 401 no valid token, 403 another
 * session's or action's token, 404, 409, 413, 503) and its `{"error": ...}` body. */
export class GatewayError extends Error {
  readonly status: number;
  readonly body: unknown;

  constructor(status: number, body: unknown) {
    const reason =
      typeof body === "object" && body !== null && "error" in body
        ? String((body as { error: unknown }).error)
        : `HTTP ${status}`;
    super(`${status}: ${reason}`);
    this.name = "GatewayError";
    this.status = status;
    this.body = body;
  }
}

export interface ClientOptions {
  /** The gateway's URL, e.g. `https://bot.example.com`. */
  baseUrl: string;
  /** The server token, or a session token; a function is asked before every request (renew
   * a session token there). */
  token?: string | (() => string | Promise<string>);
  fetch?: typeof fetch;
  /** Reconnections in a row without news before a stream gives up (default 5). */
  maxReconnects?: number;
  /** The first wait before a reconnection, doubled each time up to 5 s (default 250 ms). */
  reconnectDelayMs?: number;
}

const enc = encodeURIComponent;

export class DialogClient {
  readonly #baseUrl: string;
  readonly #token: ClientOptions["token"];
  readonly #fetch: typeof fetch;
  readonly #maxReconnects: number;
  readonly #reconnectDelayMs: number;

  constructor(options: ClientOptions) {
    this.#baseUrl = options.baseUrl.replace(/\/+$/, "");
    this.#token = options.token;
    this.#fetch = options.fetch ?? globalThis.fetch.bind(globalThis);
    this.#maxReconnects = options.maxReconnects ?? 5;
    this.#reconnectDelayMs = options.reconnectDelayMs ?? 250;
  }

  /** Sends a message (202): its `msg_id` is made here when not given, so a retry after a
   * failure (a 503 names it too) cannot apply it twice. */
  async send(sessionId: string, text: string, options: SendOptions = {}): Promise<Sent> {
    const body = {
      text,
      msg_id: options.msgId ?? randomId(),
      meta: options.meta,
      multitask: options.multitask,
      expires_at: options.expiresAt,
      deliver_at: options.deliverAt,
    };
    return this.#json("POST", `/sessions/${enc(sessionId)}/messages`, body, options.signal);
  }

  /** The answer to one message as it is written, ending with its `end`. From `after` (the
   * cursor of the last event you handled) on: each piece once. A dropped connection is
   * resumed from the last cursor by itself; a cursor already at the end yields nothing. */
  async *stream(
    sessionId: string,
    msgId: string,
    options: { after?: string; signal?: AbortSignal } = {},
  ): AsyncGenerator<AnswerEvent, void, undefined> {
    let cursor = options.after;
    const path = `/sessions/${enc(sessionId)}/messages/${enc(msgId)}/stream`;
    for await (const event of this.#follow(path, () => cursor, options.signal)) {
      const answer = JSON.parse(event.data) as AnswerEvent;
      if (event.id !== undefined) cursor = event.id;
      yield answer;
      if (answer.kind === "end") return;
    }
  }

  /** Cancels one message (idempotent): `cancelled` (it ends so), `finished` or `pending`. */
  async cancel(sessionId: string, msgId: string): Promise<CancelResult> {
    return this.#json("POST", `/sessions/${enc(sessionId)}/messages/${enc(msgId)}/cancel`);
  }

  /** Every turn of the session as it ends (and `awaiting`, `resync`), until `signal` aborts
   * or you stop iterating; reconnects from its cursor by itself. */
  async *events(
    sessionId: string,
    options: { after?: string; signal?: AbortSignal } = {},
  ): AsyncGenerator<SessionEvent, void, undefined> {
    let cursor = options.after;
    const path = `/sessions/${enc(sessionId)}/events`;
    for await (const event of this.#follow(path, () => cursor, options.signal, true)) {
      if (event.id !== undefined) cursor = event.id;
      yield { kind: event.event, cursor: event.id, data: JSON.parse(event.data) } as SessionEvent;
    }
  }

  /** What the session waits on (a step's `interrupt`): at most one. */
  async pending(sessionId: string): Promise<PendingInterrupt[]> {
    const answer = await this.#json<{ pending: PendingInterrupt[] }>(
      "GET",
      `/sessions/${enc(sessionId)}/pending`,
    );
    return answer.pending;
  }

  /** Answers an interrupt with `value` (any JSON): applied once however often it is sent.
   * An interrupt that ended otherwise (409) or is unknown (404) resolves with its status. */
  async resume(sessionId: string, interruptId: string, value: unknown): Promise<ResumeResult> {
    const path = `/sessions/${enc(sessionId)}/interrupts/${enc(interruptId)}/resume`;
    return this.#json("POST", path, { value }, undefined, [404, 409]);
  }

  async #headers(extra: Record<string, string> = {}): Promise<Record<string, string>> {
    const token = typeof this.#token === "function" ? await this.#token() : this.#token;
    return token ? { ...extra, Authorization: `Bearer ${token}` } : extra;
  }

  async #json<T>(
    method: string,
    path: string,
    body?: unknown,
    signal?: AbortSignal,
    answered: number[] = [],
  ): Promise<T> {
    const headers = await this.#headers(body === undefined ? {} : { "Content-Type": "application/json" });
    const init: RequestInit = { method, headers };
    if (body !== undefined) init.body = JSON.stringify(body);
    if (signal !== undefined) init.signal = signal;
    const response = await this.#fetch(`${this.#baseUrl}${path}`, init);
    const parsed: unknown = await response.json().catch(() => null);
    if (!response.ok && !answered.includes(response.status)) {
      throw new GatewayError(response.status, parsed);
    }
    return parsed as T;
  }

  /** The server-sent events of `path` from the cursor `after()` gives, across reconnections:
   * a connection that ends (or breaks) before the caller is done is opened again from the
   * newest cursor; `forever`: even when it ended cleanly (a session's events never end). */
  async *#follow(
    path: string,
    after: () => string | undefined,
    signal: AbortSignal | undefined,
    forever = false,
  ): AsyncGenerator<{ event: string; data: string; id: string | undefined }, void, undefined> {
    let failures = 0;
    while (!signal?.aborted) {
      let response: Response | undefined;
      try {
        const cursor = after();
        const query = cursor === undefined ? "" : `?after=${enc(cursor)}`;
        const init: RequestInit = {
          headers: await this.#headers({ Accept: "text/event-stream" }),
        };
        if (signal !== undefined) init.signal = signal;
        response = await this.#fetch(`${this.#baseUrl}${path}${query}`, init);
        if (response.status === 204) return; // nothing is live after this cursor
        if (!response.ok || response.body === null) {
          const error = new GatewayError(response.status, await response.json().catch(() => null));
          if (response.status !== 503) throw error;
          throw new Retry(error);
        }
        let progressed = false;
        try {
          for await (const event of parseSSE(response.body)) {
            progressed = true;
            failures = 0;
            yield event;
          }
        } finally {
          await response.body.cancel().catch(() => undefined); // the caller stopped early
        }
        if (!progressed && !forever) failures += 1;
      } catch (error) {
        if (signal?.aborted) return;
        if (error instanceof GatewayError) throw error;
        failures += 1;
        if (failures > this.#maxReconnects) {
          throw error instanceof Retry ? error.cause : error;
        }
      }
      if (failures > this.#maxReconnects) return;
      await sleep(Math.min(5000, this.#reconnectDelayMs * 2 ** Math.max(0, failures - 1)), signal);
    }
  }
}

class Retry extends Error {
  override readonly cause: GatewayError;

  constructor(cause: GatewayError) {
    super(cause.message);
    this.cause = cause;
  }
}

function randomId(): string {
  return globalThis.crypto.randomUUID().replaceAll("-", "");
}

function sleep(ms: number, signal: AbortSignal | undefined): Promise<void> {
  return new Promise((resolve) => {
    const timer = setTimeout(resolve, ms);
    signal?.addEventListener(
      "abort",
      () => {
        clearTimeout(timer);
        resolve();
      },
      { once: true },
    );
  });
}
