"""The protobuf wire form of attention.v1 tensors, written from numpy memory
and read back into numpy arrays, without a Python float per value.

`Tensor.data` is `repeated float` in proto3, so packed: on the wire one tag,
a varint byte length, then the float32 values, little-endian. That is the
byte form itself, so a request carries the array's memory as it is and an
answer's values are one slice of the received bytes. Everything else of a
message is small and goes through the generated classes (client.py).

Encoding follows the protobuf spec where a parser must be lenient: a
repeated scalar may come packed or not, and a message field that appears
more than once is merged (its repeated fields concatenated).
"""

import math

import numpy as np

# Wire types (protobuf encoding spec).
VARINT, I64, LEN, I32 = 0, 1, 2, 5
FLOAT32 = np.dtype("<f4")


class WireError(ValueError):
    """Bytes that are not the protobuf encoding the message needs; the text
    names the field, what was expected and what came."""


def varint(value):
    """The varint encoding of a non-negative int."""
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def read_varint(buf, pos, end, what):
    """(value, next position) of the varint at buf[pos], at most 10 bytes
    (a 64-bit value) and ending before `end`."""
    value = shift = 0
    while shift < 70:
        if pos >= end:
            raise WireError(f"{what}: the bytes end inside a varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    raise WireError(f"{what}: a varint longer than 10 bytes")


def int64(value):
    """A decoded varint as the int64 it encodes (negatives take 10 bytes)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >> 63 else value


def fields(buf, pos, end, what):
    """Yields (number, wire type, start, stop, field start) for each field of
    the message in buf[pos:end]. start:stop is a LEN field's payload, or the
    bytes of a fixed-size value; for a varint, start is its value and stop
    the position after it."""
    while pos < end:
        field_start = pos
        key, pos = read_varint(buf, pos, end, what)
        number, wire_type = key >> 3, key & 7
        if number == 0:
            raise WireError(f"{what}: field number 0 at byte {field_start}")
        if wire_type == VARINT:
            value, pos = read_varint(buf, pos, end, what)
            yield number, wire_type, value, pos, field_start
            continue
        if wire_type == LEN:
            size, pos = read_varint(buf, pos, end, what)
            stop = pos + size
        elif wire_type in (I64, I32):
            stop = pos + (8 if wire_type == I64 else 4)
        else:
            raise WireError(f"{what}: field {number} has wire type {wire_type} "
                            "(groups are not part of proto3)")
        if stop > end:
            raise WireError(f"{what}: field {number} needs {stop - pos} bytes; "
                            f"{end - pos} are left")
        yield number, wire_type, pos, stop, field_start
        pos = stop


def tensor_parts(number, array):
    """The bytes of message field `number` holding `array` (float32,
    C-contiguous) as an attention.v1.Tensor: a list of bytes-like parts to
    join, the last one the array's own memory."""
    shape = b"".join(varint(size) for size in array.shape)
    body = [b"\x0a", varint(len(shape)), shape]  # 1: shape, packed int64
    if array.nbytes:  # proto3 writes no empty repeated field
        body += [b"\x12", varint(array.nbytes)]  # 2: data, packed float
    head = b"".join(body)
    return [varint(number << 3 | LEN), varint(len(head) + array.nbytes), head, array]


def message_field(number, parts):
    """The bytes of message field `number` whose body is `parts` joined (bytes
    and arrays, as tensor_parts gives them): a list of parts to join."""
    size = sum(part.nbytes if isinstance(part, np.ndarray) else len(part) for part in parts)
    return [varint(number << 3 | LEN), varint(size), *parts]


def split_message(buf, wanted, what):
    """Splits the message `buf` (a memoryview) into the payloads of the LEN
    fields numbered in `wanted` ({number: [(start, stop), ...]}, every
    occurrence, in order) and the bytes of all other fields, joined."""
    found = {number: [] for number in wanted}
    rest = []
    for number, wire_type, start, stop, field_start in fields(buf, 0, len(buf), what):
        if number in found and wire_type == LEN:
            found[number].append((start, stop))
        else:
            rest.append(buf[field_start:stop])
    return found, b"".join(rest)


def tensor_array(buf, ranges, what):
    """The float32 array of the Tensor whose occurrences are buf[start:stop]
    for (start, stop) in ranges (merged, as protobuf merges a repeated
    message field), shaped by its `shape`. A read-only view of `buf` when the
    values came as one packed run, as every encoder writes them."""
    shape, runs = [], []
    for start, stop in ranges:
        for number, wire_type, value, end, _ in fields(buf, start, stop, what):
            if number == 1 and wire_type == VARINT:
                shape.append(int64(value))
            elif number == 1 and wire_type == LEN:
                pos = value
                while pos < end:
                    size, pos = read_varint(buf, pos, end, f"{what}.shape")
                    shape.append(int64(size))
            elif number == 2 and wire_type in (LEN, I32):
                if (end - value) % 4:
                    raise WireError(f"{what}.data: {end - value} bytes of packed float32, "
                                    "not a multiple of 4")
                runs.append(buf[value:end])
    values = np.frombuffer(runs[0] if len(runs) == 1 else b"".join(runs), dtype=FLOAT32)
    if any(size < 0 for size in shape):
        raise WireError(f"{what}: shape {shape} has a negative size")
    if math.prod(shape) != values.size:
        raise WireError(f"{what}: shape {shape} needs {math.prod(shape)} float32 values; "
                        f"{values.size} came")
    return values.reshape(shape)
