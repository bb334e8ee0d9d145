"""Images: decoding and checking bytes, fetching URLs, stored image references, the decoded-image cache."""
