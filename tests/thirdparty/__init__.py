"""Models this project did not write, as their authors write them, for the third-party tests:
Hugging Face ``transformers`` models built from small configs (random weights, nothing
downloaded) and a single-file GPT in the style widely copied from nanoGPT. The SDK must train
them unedited."""
