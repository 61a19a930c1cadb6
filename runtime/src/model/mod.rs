//! Model front end (being written).
