// The page's only way to the server: fetch with the API key, and server-sent events read from a
// fetch body (so the key travels in the Authorization header, never in a URL).
// The key lives in this module's memory only: not in localStorage, a cookie or the address bar,
// so it is gone when the tab closes.

let apiKey = null;

export class AuthError extends Error {}

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export function setKey(key) {
  apiKey = key || null;
}

export async function api(path, init = {}) {
  const headers = new Headers(init.headers || {});
  if (apiKey) headers.set("Authorization", `Bearer ${apiKey}`);
  const res = await fetch(path, { ...init, headers });
  if (res.status === 401) throw new AuthError("this server needs an API key");
  if (!res.ok) throw new ApiError(res.status, await errorMessage(res));
  return res;
}

async function errorMessage(res) {
  // OpenAI's error body: {"error": {"message", "type", "param", "code"}}
  try {
    const body = await res.json();
    return body.error?.message || `HTTP ${res.status}`;
  } catch {
    return `HTTP ${res.status}`;
  }
}

// The `data:` payloads of a server-sent event stream, as strings, in order.
export async function* sseData(res) {
  const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = block
          .split("\n")
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).replace(/^ /, ""))
          .join("\n");
        if (data) yield data;
      }
    }
  } finally {
    reader.cancel().catch(() => {}); // a consumer that stops early closes the connection
  }
}
