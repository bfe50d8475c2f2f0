"""`scalerl generate` on a saved model directory with its tokenizer."""

from scalerl.checkpoint.export import export_hf_model as save_policy
from scalerl.cli import main
from scalerl.models.tokenizer import CharTokenizer
from scalerl.rollout.text import generate_text
from tests.tiny import tiny_run_model


def test_generate_from_a_saved_directory(tmp_path, capsys):
    tok = CharTokenizer()
    model = tiny_run_model(tok, seed=1)
    save_policy(model, tok, tmp_path / "m")
    texts = generate_text(str(tmp_path / "m"), ["Q:1+1\nA:", "abc"], max_new_tokens=6, temperature=0)
    assert len(texts) == 2 and all(isinstance(t, str) and len(t) <= 6 for t in texts)
    assert generate_text(str(tmp_path / "m"), ["abc"], max_new_tokens=6, temperature=0)[0] == texts[1]
    assert main(["generate", "--model", str(tmp_path / "m"), "--prompt", "abc", "--max-new-tokens", "6",
                 "--temperature", "0"]) == 0
    assert f"abc{texts[1]}" in capsys.readouterr().out
