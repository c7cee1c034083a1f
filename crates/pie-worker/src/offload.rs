//! The offload wire format: a peer answers `POST /v1/internal/prefill`
//! `{"tokens": [...]}` with the prompt's full KV pages, each as a u32 LE length
//! followed by the page in `pie_kv::transfer` format.

/// Frame pages for the response body.
pub fn join_pages(pages: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::with_capacity(pages.iter().map(|p| p.len() + 4).sum());
    for p in pages {
        out.extend_from_slice(&(p.len() as u32).to_le_bytes());
        out.extend_from_slice(p);
    }
    out
}

/// Split a response body back into pages; a torn body is an error.
pub fn split_pages(mut body: &[u8]) -> Result<Vec<Vec<u8>>, String> {
    let mut pages = Vec::new();
    while !body.is_empty() {
        let len = body
            .get(..4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")) as usize)
            .ok_or("truncated page length")?;
        let page = body.get(4..4 + len).ok_or("truncated page")?;
        pages.push(page.to_vec());
        body = &body[4 + len..];
    }
    Ok(pages)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_torn_bodies_fail() {
        let pages = vec![vec![1, 2, 3], vec![], vec![9; 10]];
        let body = join_pages(&pages);
        assert_eq!(split_pages(&body).unwrap(), pages);
        assert!(split_pages(&body[..body.len() - 1]).is_err());
        assert!(split_pages(&[1, 0]).is_err());
    }
}
