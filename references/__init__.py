"""Naive torch references, one per op, written for clarity and computed in fp32."""
