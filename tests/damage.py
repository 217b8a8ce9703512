"""Damage a file at rest, as a failing disk would."""


def flip_bit(path, offset: int) -> None:
    """Flip one bit (0x10) of the byte at `offset`."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))
