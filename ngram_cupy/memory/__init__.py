"""OS memory that knows no format or table: anonymous, pinned and shared mappings, the
rendezvous that hands shared segments between processes, and page reads of mapped files."""
