def block_rows(rows: int) -> int:
    return 8 if rows % 8 == 0 else rows
