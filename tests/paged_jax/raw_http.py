"""A bare asyncio HTTP/1.1 client for the server's abuse tests: each request on its own connection,
the response read as it arrives (chunk times for streams), and the liberties a hostile client takes
(leaving mid-upload, mid-stream)."""
import asyncio
import json
import time


class Response:
    def __init__(self, status: int, headers: dict, body: bytes, chunk_times: list[float]):
        self.status, self.headers, self.body, self.chunk_times = status, headers, body, chunk_times

    def json(self):
        return json.loads(self.body)

    def events(self) -> list:
        """A stream's `data:` payloads, parsed, `[DONE]` as the string."""
        lines = [line[6:] for line in self.body.decode().split("\n\n") if line.startswith("data: ")]
        return [line if line == "[DONE]" else json.loads(line) for line in lines]


def _request(port: int, path: str, body: bytes, content_length: int | None = None) -> bytes:
    length = len(body) if content_length is None else content_length
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\nConnection: close\r\n\r\n").encode() + body


async def post(port: int, path: str, body, *, leave_after_chunks: int | None = None,
               chunk_times: list[float] | None = None) -> Response | None:
    """POST `body` (bytes, or an object sent as JSON). `leave_after_chunks`: close the connection
    after that many body reads of a response (0: right after sending) -> None. `chunk_times`: the
    list the arrival times go to as they come (the caller may watch it)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 24)
    try:
        writer.write(_request(port, path, data))
        await writer.drain()
        status_line = await reader.readline()
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            key, _, value = line.decode().partition(":")
            headers[key.strip().lower()] = value.strip()
        body, times = bytearray(), [] if chunk_times is None else chunk_times
        chunked = headers.get("transfer-encoding") == "chunked"
        while True:
            if leave_after_chunks is not None and len(times) >= leave_after_chunks:
                return None
            if chunked:
                size = int((await reader.readline()).strip() or b"0", 16)
                if size == 0:
                    break
                body += await reader.readexactly(size)
                await reader.readline()
            else:
                piece = await reader.read(1 << 16)
                if not piece:
                    break
                body += piece
            times.append(time.monotonic())
        return Response(int(status_line.split()[1]), headers, bytes(body), times)
    finally:
        writer.close()


async def leave_mid_upload(port: int, path: str = "/v1/completions") -> None:
    """Promise a body of 1 MiB, send 10 bytes of it and close."""
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_request(port, path, b'{"prompt":', content_length=1 << 20))
    await writer.drain()
    writer.close()
