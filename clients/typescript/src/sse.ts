// Server-sent events read from a fetch() body: lines split on \n, \r\n or \r, comment lines
// (the gateway's keep-alives) skipped, multi-line data joined; an event's id is the one it
// carries (the gateway puts a cursor on every event a reader may resume after).

export interface ServerEvent {
  event: string;
  data: string;
  id: string | undefined;
}

export async function* parseSSE(
  body: ReadableStream<Uint8Array>,
): AsyncGenerator<ServerEvent, void, undefined> {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let event = "";
  let data: string[] = [];
  let id: string | undefined;
  let hasId = false;
  const flush = (): ServerEvent | undefined => {
    const ready =
      event || data.length
        ? { event: event || "message", data: data.join("\n"), id: hasId ? id : undefined }
        : undefined;
    event = "";
    data = [];
    hasId = false;
    return ready;
  };
  try {
    while (true) {
      const { done, value } = await reader.read();
      buffer += done ? decoder.decode() : decoder.decode(value, { stream: true });
      let cut: RegExpExecArray | null;
      const newline = /\r\n|\r|\n/g;
      let start = 0;
      while ((cut = newline.exec(buffer)) !== null) {
        // A \r at the very end may be half of a \r\n still on its way.
        if (cut[0] === "\r" && cut.index === buffer.length - 1 && !done) break;
        const line = buffer.slice(start, cut.index);
        start = cut.index + cut[0].length;
        if (line === "") {
          const ready = flush();
          if (ready) yield ready;
          continue;
        }
        if (line.startsWith(":")) continue;
        const colon = line.indexOf(":");
        const field = colon === -1 ? line : line.slice(0, colon);
        let value = colon === -1 ? "" : line.slice(colon + 1);
        if (value.startsWith(" ")) value = value.slice(1);
        if (field === "event") event = value;
        else if (field === "data") data.push(value);
        else if (field === "id" && !value.includes("\0")) {
          id = value;
          hasId = true;
        }
      }
      buffer = buffer.slice(start);
      if (done) break; // an event cut off by the end of the body is dropped, as browsers do
    }
  } finally {
    reader.releaseLock();
  }
}
